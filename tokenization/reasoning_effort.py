"""How a request's reasoning effort reaches the chat template, as vLLM 0.33.0 renders it.

Chat ``reasoning_effort``, Responses ``reasoning.effort`` and Messages ``output_config.effort`` /
``thinking`` all end as a chat's ``reasoning_effort``, which ``build_chat_params`` turns into template
kwargs (`effort_kwargs`). Two engine options change that, so the router must know them
(`EffortRendering`, from a model's config):

- ``--reasoning-effort-map`` (``map_reasoning_effort``): an effort is renamed before rendering;
  efforts not listed pass unchanged;
- ``--anthropic-disabled-thinking-effort`` (``DisabledThinkingEffortResolver``): the effort a
  Messages ``thinking: {"type": "disabled"}`` renders with; ``auto`` (the default) asks the template
  (`probe_disabled_effort`): ``"none"``, unless rendering with it fails or gives the same prompt as
  one of the Anthropic efforts, then ``"low"``.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, get_args

import msgspec

__all__ = [
    "ANTHROPIC_EFFORTS",
    "AnthropicEffort",
    "DisabledThinkingEffort",
    "EffortRendering",
    "ReasoningEffort",
    "effort_kwargs",
    "probe_disabled_effort",
]

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""A chat's (and a Responses request's) ``reasoning_effort`` (vLLM's ``ReasoningEffort``; others: 400)."""
AnthropicEffort = Literal["low", "medium", "high", "xhigh", "max"]
"""A Messages ``output_config.effort`` (vLLM's ``AnthropicEffort``; others: 400)."""
DisabledThinkingEffort = Literal["auto", "none", "low", "medium", "high", "xhigh", "max"]
"""``--anthropic-disabled-thinking-effort``'s values (``auto``: probe the template)."""
ANTHROPIC_EFFORTS: Final = get_args(AnthropicEffort)
"""In vLLM's order: the probe compares ``"none"``'s render with each of these."""


class EffortRendering(msgspec.Struct, frozen=True):
    """The engines' options that decide how an effort is rendered (vLLM's defaults when unset)."""

    effort_map: tuple[tuple[str, str], ...] = ()
    """``--reasoning-effort-map``'s pairs (effort, rendered as)."""
    disabled_thinking_effort: DisabledThinkingEffort = "auto"
    """``--anthropic-disabled-thinking-effort``."""

    @classmethod
    def of(
        cls, effort_map: Mapping[ReasoningEffort, str], disabled_thinking_effort: DisabledThinkingEffort
    ) -> EffortRendering:
        """From a model's config keys (a hashable value: probes are cached by it)."""
        return cls(tuple(sorted(effort_map.items())), disabled_thinking_effort)

    def mapped(self, effort: str) -> str:
        """``map_reasoning_effort``: the effort the template gets for `effort`."""
        for name, rendered_as in self.effort_map:
            if name == effort:
                return rendered_as
        return effort


def effort_kwargs(
    effort: str, user_kwargs: Mapping[str, Any] | None, rendering: EffortRendering, kwargs: dict[str, Any]
) -> None:
    """``build_chat_params``' effort kwargs, set in `kwargs` (the request's ``chat_template_kwargs``,
    copied): the mapped effort over the kwargs' own unless it is ``"auto"`` (an unset value of vLLM's
    merge), and ``enable_thinking`` (false for ``"none"``) unless `user_kwargs` sets it."""
    effort = rendering.mapped(effort)
    if "enable_thinking" not in (user_kwargs or {}):
        kwargs["enable_thinking"] = effort != "none"
    if effort != "auto":
        kwargs["reasoning_effort"] = effort


def probe_disabled_effort(render: Callable[[ReasoningEffort], str | None]) -> Literal["none", "low"]:
    """``DisabledThinkingEffortResolver._probe``: `render` gives the prompt of a one-message chat
    (``Hi``) rendered with an effort, or None when the template fails on it. ``"low"`` when ``"none"``
    fails or renders as some Anthropic effort does (the template ignores it), else ``"none"``."""
    none = render("none")
    if none is None:
        return "low"
    if any(render(effort) == none for effort in ANTHROPIC_EFFORTS):
        return "low"
    return "none"
