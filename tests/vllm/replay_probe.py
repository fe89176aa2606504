"""Ask an engine's replay endpoint for the last seq it published (to wait for a mirror to catch up).

vLLM publishes a step's events before that step's tokens, so once a response is complete the replay
buffer holds every batch the request caused; the mirror has caught up when it applied that seq.
"""

from __future__ import annotations

import zmq

from events.frames import ReplayEnd, parse_replay_reply, replay_request_parts

__all__ = ["last_published_seq"]


def last_published_seq(replay_endpoint: str, start_seq: int = 0, timeout_s: float = 10.0) -> int:
    """The highest seq in the engine's replay buffer from `start_seq` on (-1 if none); TimeoutError if it
    does not answer. Start at a seq known to be buffered (the mirror's last) to keep the reply short."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart(replay_request_parts(start_seq))
        last = -1
        while True:
            try:
                reply = parse_replay_reply(sock.recv_multipart())
            except zmq.Again as exc:
                raise TimeoutError(f"no replay reply from {replay_endpoint} in {timeout_s} s") from exc
            if isinstance(reply, ReplayEnd):
                return last
            last = max(last, reply.seq)
    finally:
        sock.close()
