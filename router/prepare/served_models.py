"""Per-model tokenization and block keys: an OpenAI request body -> `Prepared`, what routing needs.

Each model has a tokenizer (an HF tokenizer.json + chat template, or the built-in tokenizer when none
is configured), loaded once per distinct source so its segment cache is shared and multi-turn chats
re-encode only their new turns. Keys are the router's keyed hash (`KeyHasher`, which must be the
mirror's: both default to one per-process hasher) or, in engine-exact mode, vLLM's own block hash.
Engines that override the tokenizer or layout get their own `Variant`; `prepare` computes keys for
every variant of the model it knows (`learn` adds runtime engines), and routing looks each replica
up with its variant's keys.

A tokenizer named by HF repo id is resolved through the hub once, by `fetch_hub` (the gateway calls it
at startup, on a thread, bounded; other tools resolve on first use). A repo whose files cannot be had
makes its model take prompt ids from an engine's /tokenize (`needs_remote`), as `remote_tokenize`
does; the built-in tokenizer stands in only when no engine answers either (no hits predicted). After
`fetch_hub`, a repo first named later (an engine added at run time) is read from the cache alone: a
request never waits on the network; if it is not cached, that engine's variant is keyed by the
built-in tokenizer (no hit predicted on it). The gateway fetches what is missing again in the
background (router.links.hub_retry); files that arrive are adopted (`adopt_hub`) and their models
tokenize locally again.

What a preparation keeps for later requests (the chat decoder's messages, the chat carry's turn, the
segment cache's pieces, prefix reuse's text, the recent prompts' keys) each cache keeps as it makes
it, during `prepare`: the gateway's bookkeeping order is in router.edge.decider.Exchange. The entries
are exact whatever becomes of the request that made them, so a refusal after preparing leaves them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec

from router.core.errors import BadRequest, ModelNotFound, RouterError
from router.core.keys.block_key import KeyHasher
from router.core.keys.recent_prompts import PrefixKeyCache
from router.core.keys.request import Prior, chained, session_int, session_key, spec_keys
from router.core.policy.session_key import body_key_of
from router.core.prepared import Prepared, VariantKeys
from router.core.variant import Variant, VariantId
from router.prepare.engine_variants import DEFAULT_MODEL, engine_model, model_configs, resolve_variant
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tokenization import CachedEncoder
from tokenization.base import CacheStats, TokenizationError
from tokenization.chat_decoder import ChatDecoder
from tokenization.hub import HubRef, HubUnavailable, fetch_tokenizers
from tokenization.hub_names import hub_repo
from tokenization.loading import load_encoder
from tokenization.openai_request import (
    Endpoint,
    RequestError,
    VllmXargs,
    decode_body,
)
from tokenization.reasoning_effort import EffortRendering
from tokenization.request_tokens import VLLM_EFFORT, ApiRequest, RequestTokens, decode_request, tokens_of
from tokenization.responses_request import CheckedResponses

__all__ = ["PROCESS_HASHER", "Models", "Prepared", "UnknownModel", "VariantKeys"]

log = logging.getLogger(__name__)

PROCESS_HASHER = KeyHasher()
"""The default hasher of both `Models` and the fleet's mirror, so their keys agree."""


class UnknownModel(RequestError):
    """The request's `model` is served by no engine (`name`), or is missing while several are served."""

    def __init__(self, name: str | None, served: list[str]) -> None:
        self.name, self.served = name, served
        what = "is required: several models are served" if name is None else f"{name!r} is not served"
        super().__init__(f"`model`: {what} (served: {', '.join(served)})")

    def answer(self) -> RouterError:
        """The gateway's answer: OpenAI's 404 `model_not_found`, or a 400 naming `model` when missing."""
        if self.name is None:
            return BadRequest(str(self), param="model")
        return ModelNotFound(self.name, self.served)


class _ModelField(msgspec.Struct):
    model: str | None = None


_MODEL_FIELD = msgspec.json.Decoder(_ModelField)


class _IdFields(msgspec.Struct, omit_defaults=True):
    """The body fields besides the prompt that decide keys and routing, re-sent with a prompt of ids."""

    model: str | None = None
    stream: bool = False
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    vllm_xargs: dict[str, str] | None = None
    # The session ids (`Prepared.body_session`), carried as loosely as the request Structs type them.
    prompt_cache_key: Any = None
    conversation: Any = None
    metadata: Any = None
    user: Any = None
    safety_identifier: Any = None

    @staticmethod
    def decode_body(body: bytes) -> _IdFields:
        return decode_body(_ID_FIELDS, body, "invalid request")


_ID_FIELDS = msgspec.json.Decoder(_IdFields)


class _RouteFields(msgspec.Struct):
    """The body fields a policy that reads no prompt still needs (typed as the full decode types them)."""

    model: str | None = None
    stream: bool = False
    cache_salt: str | None = None
    vllm_xargs: VllmXargs | None = None


_ROUTE_FIELDS = msgspec.json.Decoder(_RouteFields)
_NO_TIMINGS: Mapping[str, float] = MappingProxyType({})


def _ids_of(rt: RequestTokens) -> Callable[[], tuple[int, ...]]:
    """The request's ids as `spec_keys` takes them: built only if the keys need more than the packed ids."""
    return lambda: rt.tokens


class Models:
    """Every model's tokenizer, variants and key function; `prepare` turns a body into `Prepared`."""

    def __init__(
        self,
        config: RouterConfig,
        hasher: KeyHasher | None = None,
        loras: Mapping[str, Mapping[str, str]] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        *,
        key_cache: PrefixKeyCache | None = None,
    ) -> None:
        self.hasher = hasher or PROCESS_HASHER
        self.key_cache = (
            key_cache if key_cache is not None else PrefixKeyCache(config.limits.key_cache_tokens)
        )
        self._config = config
        self._hub_timeout_s = config.timeouts.hub_fetch_s
        self._clock = clock
        self._models = model_configs(config)
        self._loras = {name: dict(getattr(m, "loras", {}) or {}) for name, m in self._models.items()}
        for name, adapters in (loras or {}).items():
            self._loras.setdefault(name, {}).update(adapters)
        self._effort = {name: _effort_rendering(m) for name, m in self._models.items()}
        self._tokenizers: dict[tuple[str | None, str | None, str | None], CachedEncoder] = {}
        self._hub: dict[HubRef, Path | HubUnavailable] = {}
        self.hub_unavailable: list[HubUnavailable] = []
        """Every repo-named tokenizer that could not be had (logged once each; the gateway counts them)."""
        self._remote = {name for name, m in self._models.items() if getattr(m, "remote_tokenize", False)}
        self._hub_fallback: set[str] = set()
        self._cache_only = False  # set by `fetch_hub`: from then on a request may be waiting
        self._count_unavailable: Callable[[str], None] = lambda reason: None
        self._chat = ChatDecoder()
        self._reads_body_session = config.policy.name == "session" and config.policy.session_body
        self._variants: dict[str, dict[VariantId, Variant]] = {
            name: {VariantId(name): resolve_variant(m)} for name, m in self._models.items()
        }
        for engine in config.engines:
            self.learn(engine)

    def names(self) -> list[str]:
        """Every model name the router knows."""
        return list(self._models)

    def config(self, model: str) -> ModelConfig:
        """A model's (configured or default) settings; KeyError if unknown."""
        return self._models[model]

    def variant(self, engine: EngineConfig) -> Variant:
        """The variant an engine's replicas use (registering a model the config did not name)."""
        name = engine_model(self._config, engine)
        if name not in self._models:
            self._models[name] = ModelConfig(name=name, block_size=engine.block_size or 16)
            self._loras[name] = {}
            self._effort[name] = VLLM_EFFORT
            self._variants[name] = {VariantId(name): resolve_variant(self._models[name])}
        return resolve_variant(self._models[name], engine)

    def learn(self, engine: EngineConfig) -> Variant:
        """Register an engine's variant so `prepare` computes its keys too; returns it."""
        v = self.variant(engine)
        self._variants[v.model].setdefault(v.id, v)
        return v

    def tokenizer(self, variant: Variant) -> CachedEncoder:
        """The variant's tokenizer with its caches (`CachedEncoder`), loaded on first use and shared by
        every variant with its source."""
        key = variant.tokenizer_source
        tok = self._tokenizers.get(key)
        if tok is None:
            tok = self._tokenizers[key] = self._load(variant)
        return tok

    def _load(self, variant: Variant) -> CachedEncoder:
        """Load a variant's tokenizer: from its path, its repo's resolved files, or (a repo that cannot
        be had) the built-in one, which serves only when no engine's /tokenize answers."""
        ref = _hub_ref(variant)
        if ref is None:
            return load_encoder(variant.tokenizer, variant.chat_template)
        if ref not in self._hub:  # not fetched at startup: a tool, or an engine added at run time
            self._resolve([ref], self._hub_timeout_s)
        found = self._hub[ref]
        if isinstance(found, HubUnavailable):
            return load_encoder(None, variant.chat_template)
        return load_encoder(str(found), variant.chat_template)

    def fetch_hub(self, timeout_s: float | None = None) -> None:
        """Resolve every repo-named tokenizer of the variants known now through the HF hub, waiting at
        most `timeout_s` (None: the config's `timeouts.hub_fetch_s`), and load each (so no request
        waits for it). What cannot be had, or does not load, is logged and listed in
        `hub_unavailable`; its model then tokenizes on an engine."""
        variants = [v for by_id in self._variants.values() for v in by_id.values()]
        refs = [ref for v in variants if (ref := _hub_ref(v)) is not None and ref not in self._hub]
        self._resolve(refs, self._hub_timeout_s if timeout_s is None else timeout_s)
        for v in variants:
            ref = _hub_ref(v)
            if ref is None or isinstance(self._hub[ref], HubUnavailable):
                continue
            try:
                self.tokenizer(v)
            except (TokenizationError, OSError) as exc:
                self._unavailable(HubUnavailable(ref, "unreadable", str(exc)))
                self._tokenizers.pop(v.tokenizer_source, None)
        self._cache_only = True

    def hub_missing(self) -> dict[HubRef, list[Variant]]:
        """Each repo-named tokenizer not had (startup's failures, and repos first named later that the
        cache did not hold) with the variants reading it: what a retry fetches (router.links.hub_retry).
        Read on the event loop, a snapshot the retry's thread may read."""
        variants = [v for by_id in self._variants.values() for v in by_id.values()]
        missing = [ref for ref, found in self._hub.items() if isinstance(found, HubUnavailable)]
        return {ref: [v for v in variants if _hub_ref(v) == ref] for ref in missing}

    def adopt_hub(
        self,
        ref: HubRef,
        path: Path,
        encoders: Mapping[tuple[str | None, str | None, str | None], CachedEncoder],
    ) -> list[str]:
        """A missing repo's files arrived (`hub_missing`) and loaded as `encoders` (by tokenizer source):
        its variants tokenize with them from now on, and each model all of whose repos are now had takes
        its prompt ids locally again (not one configured `remote_tokenize`). The models switched back."""
        self._hub[ref] = path
        self._tokenizers.update(encoders)
        back = []
        for name in sorted(self._hub_fallback):
            refs = {r for v in self._variants[name].values() if (r := _hub_ref(v)) is not None}
            if not any(isinstance(self._hub.get(r), HubUnavailable) for r in refs):
                self._hub_fallback.discard(name)
                if not getattr(self._models[name], "remote_tokenize", False):
                    self._remote.discard(name)
                back.append(name)
        log.warning(
            "tokenizer resolved through the HF hub after startup: tokenizing locally",
            extra={"repo": ref[0], "path": str(path), "models": back},
        )
        return back

    def on_hub_unavailable(self, count: Callable[[str], None]) -> None:
        """Call `count(reason)` for each repo that could not be had: those so far, then each one later."""
        self._count_unavailable = count
        for exc in self.hub_unavailable:
            count(exc.reason)

    def _resolve(self, refs: list[HubRef], timeout_s: float) -> None:
        for ref, found in fetch_tokenizers(refs, timeout_s, self._cache_only).items():
            if isinstance(found, HubUnavailable):
                self._unavailable(found)
            else:
                self._hub[ref] = found
                log.info("tokenizer resolved through the HF hub", extra={"repo": ref[0], "path": str(found)})

    def _unavailable(self, exc: HubUnavailable) -> None:
        """Record a repo that cannot be had: every model with a variant reading it tokenizes remotely
        (unless found after startup: the gateway reads `any_remote` once, so the models stay as they
        were and only the variant that names it falls back to the built-in tokenizer)."""
        self._hub[exc.ref] = exc
        self.hub_unavailable.append(exc)
        self._count_unavailable(exc.reason)
        for name, by_id in self._variants.items():
            if not self._cache_only and any(_hub_ref(v) == exc.ref for v in by_id.values()):
                self._remote.add(name)
                self._hub_fallback.add(name)
        # The message names the repo, revision, reason and the library's explanation; never a token.
        log.warning("tokenizer unavailable: the engines' /tokenize stands in", extra={"error": str(exc)})

    def tokenizer_stats(self) -> list[CacheStats]:
        """The reuse counters of every tokenizer loaded so far (for metrics)."""
        return [tok.stats() for tok in self._tokenizers.values()]

    def resolve(self, body: bytes, model_hint: str | None = None) -> str:
        """The model a request is for: its `model` (or a LoRA of it), else the hint, else the only model."""
        name = decode_body(_MODEL_FIELD, body, "invalid request").model or model_hint
        return self.resolve_name(name)

    def served(self) -> list[str]:
        """Every name a request may give as its `model`: the models and their LoRA adapters."""
        return sorted({*self._models, *(a for adapters in self._loras.values() for a in adapters)})

    def resolve_name(self, name: str | None) -> str:
        """The model `name` (a model or one of its LoRA adapters) is served by; no name means the only
        model. UnknownModel otherwise, except when the config names no model at all (the engines'
        single model is then `DEFAULT_MODEL`, its real name unknown, and any name is passed on)."""
        if name in self._models:
            return name
        for base, adapters in self._loras.items():
            if name in adapters:
                return base
        if len(self._models) == 1 and (name is None or DEFAULT_MODEL in self._models):
            return next(iter(self._models))
        raise UnknownModel(name, self.served())

    def _decode(
        self, body: bytes, endpoint: Endpoint | str, model_hint: str | None
    ) -> tuple[ApiRequest, str]:
        """The request decoded once, and its model; errors as `resolve` then `request_tokens` raise them."""
        try:
            req = decode_request(body, endpoint, self._chat)
        except RequestError:
            self.resolve(body, model_hint)  # a bad or unknown `model` is reported first
            raise
        return req, self.resolve_name(req.model or model_hint)

    def needs_remote(self, model: str) -> bool:
        """Whether the model takes its prompt ids from an engine's /tokenize: configured so
        (`ModelConfig.remote_tokenize`, when the config has that field), or its repo-named tokenizer
        could not be had (`fetch_hub`)."""
        return model in self._remote

    def any_remote(self) -> bool:
        """Whether some model takes its prompt ids from an engine's /tokenize (`needs_remote`)."""
        return bool(self._remote)

    def prepare_fallback(self, body: bytes, endpoint: Endpoint | str, model: str) -> Prepared:
        """`prepare` for a `needs_remote` model when no engine's /tokenize answered: its own tokenizer,
        or the built-in one (`tokenizer = "builtin"`: no hit can be predicted) when its repo could not
        be had."""
        prepared = self.prepare(body, endpoint, model)
        if model in self._hub_fallback:
            return msgspec.structs.replace(prepared, tokenizer="builtin")
        return prepared

    def prepare_tokens(
        self,
        body: bytes,
        endpoint: Endpoint | str,
        tokens: list[int],
        model_hint: str | None = None,
    ) -> Prepared:
        """`prepare` with the prompt ids an engine's /tokenize returned (router.prepare.remote_tokenize);
        every variant of the model is keyed from these ids, the other fields come from the body."""
        fields = _IdFields.decode_body(body)
        ids_body = msgspec.json.encode({**msgspec.structs.asdict(fields), "prompt": tokens})
        model = self.resolve(body, model_hint)
        req = decode_request(ids_body, Endpoint.COMPLETIONS)
        prepared = self._prepare(req, endpoint, model, single_tokenizer=True)  # ids as a completion
        # whose ids: the engine's /tokenize, or its render of a Messages or Responses body
        rendered = endpoint == Endpoint.MESSAGES or endpoint == Endpoint.RESPONSES
        return msgspec.structs.replace(prepared, tokenizer="remote_render" if rendered else "remote")

    def prepare_unread(self, body: bytes, endpoint: Endpoint | str) -> Prepared | None:
        """What routing needs when it reads no prompt: the model and stream flag (the body's JSON is
        still checked whole), nothing tokenized. None when the request asks for full cache reports,
        which the mirror must tell apart from stores by the request's keys (`prepare` then)."""
        fields = decode_body(_ROUTE_FIELDS, body, "invalid request")
        if fields.vllm_xargs is not None and fields.vllm_xargs.kv_cache_report_mode == "full":
            return None
        model = self.resolve_name(fields.model)
        return Prepared(
            model=model,
            endpoint=Endpoint(endpoint),
            stream=fields.stream,
            prompt_tokens=0,
            keys=[],
            skip_cache=False,
            report_mode="incremental",
            session_key="",
            timings=_NO_TIMINGS,
            variant=model,
            cache_salt=fields.cache_salt,
            unread=True,
        )

    def prepare(self, body: bytes, endpoint: Endpoint | str, model_hint: str | None = None) -> Prepared:
        """Tokenize and key a request body; RequestError (a 400 naming the field) on bad input."""
        req, model = self._decode(body, endpoint, model_hint)
        return self._prepare(req, endpoint, model)

    def _prepare(
        self,
        req: ApiRequest,
        endpoint: Endpoint | str,
        model: str,
        single_tokenizer: bool = False,
    ) -> Prepared:
        by_id = self._variants[model]
        if len(by_id) == 1:
            return self._prepare_one(req, endpoint, model, by_id[VariantId(model)])
        variants = list(by_id.values())
        tokenize = hashing = 0.0
        by_tokenizer: dict[tuple[str | None, str | None, str | None], RequestTokens] = {}
        computed: dict[str, VariantKeys] = {}
        first: RequestTokens | None = None
        for v in variants:
            t0 = self._clock()
            source = (None, None, None) if single_tokenizer else v.tokenizer_source
            rt = by_tokenizer.get(source)
            if rt is None:
                rt = by_tokenizer[source] = tokens_of(
                    req, self.tokenizer(v), self._loras[model], self._effort[model]
                )
            t1 = self._clock()
            link = rt.first.link
            keys = spec_keys(
                v.spec,
                self.hasher,
                _ids_of(rt),
                rt.extras,
                packed=rt.first,
                cache=self.key_cache,
                prior=Prior(link.shared_tokens, link.prior) if link is not None else None,
            )
            if link is not None and chained(v.spec, rt.extras, self.key_cache):
                root = self.hasher.root(rt.extras.lora_name, rt.extras.cache_salt)
                link.own[(root, v.spec.hash_block_size)] = tuple(keys)
            computed[v.id] = VariantKeys(rt.num_tokens, keys)
            tokenize, hashing = tokenize + (t1 - t0), hashing + (self._clock() - t1)
            first = first or rt
        assert first is not None, "every model has its own variant"
        main = computed.pop(model)
        return Prepared(
            model=model,
            endpoint=endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint),
            stream=first.stream,
            prompt_tokens=main.num_tokens,
            keys=main.keys,
            skip_cache=first.skip_cache,
            report_mode=str(first.report_mode),  # a C call (Enum.value is a Python-level property)
            session_key=session_key(_ids_of(first), first.extras, first.first),
            body_session=self._body_session(req),
            timings=MappingProxyType({"tokenize": tokenize, "hash": hashing}),
            variant=model,
            variants=MappingProxyType(computed),
            lora_name=first.extras.lora_name,
            cache_salt=first.extras.cache_salt,
        )

    def _body_session(self, req: ApiRequest) -> str | None:
        """The session key `req`'s body ids name, when the policy reads it (`Prepared.body_session`)."""
        if not self._reads_body_session:
            return None
        return body_key_of(req.request if isinstance(req, CheckedResponses) else req)

    def _prepare_one(self, req: ApiRequest, endpoint: Endpoint | str, model: str, v: Variant) -> Prepared:
        """`_prepare` for a model with its own variant only (the common case): the same `Prepared`,
        without the per-variant maps (a request's ids are the same from either tokenizer source)."""
        clock = self._clock
        t0 = clock()
        rt = tokens_of(req, self.tokenizer(v), self._loras[model], self._effort[model])
        t1 = clock()
        packed, extras = rt.first, rt.extras
        ids, link = _ids_of(rt), packed.link
        root = self.hasher.root(extras.lora_name, extras.cache_salt)  # once, for both keys
        prior = Prior(link.shared_tokens, link.prior) if link is not None else None
        keys = spec_keys(
            v.spec, self.hasher, ids, extras, packed=packed, cache=self.key_cache, prior=prior, root=root
        )
        key = session_key(ids, extras, packed, prior, root)
        if link is not None:  # what the conversation's next turn extends (tokenization.chat_carry)
            if chained(v.spec, extras, self.key_cache):
                link.own[(root, v.spec.hash_block_size)] = tuple(keys)
            link.own[(root, 0)] = session_int(key)
        t2 = clock()
        return Prepared(
            model=model,
            endpoint=endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint),
            stream=rt.stream,
            prompt_tokens=packed.count,  # `rt.num_tokens` without the property's call
            keys=keys,
            skip_cache=rt.skip_cache,
            report_mode=str(rt.report_mode),  # a C call (Enum.value is a Python-level property)
            session_key=key,
            body_session=self._body_session(req),
            timings=MappingProxyType({"tokenize": t1 - t0, "hash": t2 - t1}),
            variant=model,
            lora_name=extras.lora_name,
            cache_salt=extras.cache_salt,
        )


def _hub_ref(variant: Variant) -> HubRef | None:
    """The HF repo (and revision) the variant's tokenizer is named by, or None for a path or none."""
    repo = hub_repo(variant.tokenizer) if variant.tokenizer is not None else None
    return (repo, variant.tokenizer_revision) if repo is not None else None


def _effort_rendering(model: ModelConfig) -> EffortRendering:
    """How `model`'s engines render a reasoning effort (its `reasoning_effort_map` and
    `anthropic_disabled_thinking_effort`)."""
    return EffortRendering.of(model.reasoning_effort_map, model.anthropic_disabled_thinking_effort)
