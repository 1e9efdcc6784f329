"""Serve an exact toy target over HTTP (the integration tests start this as a separate process).

    python tests/toy_server.py --port P [--vocab 4 --order 2 --seed 0] [--api-key K] [...]

The tests build the same ``ToyLM(vocab, order=order, seed=seed)`` locally, so local and remote
runs can be compared token for token and against exact laws.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from specdec.drafters import ModelDrafter
from specdec.models.toy import ToyLM
from specdec.server import ServerSettings, create_app
from specdec.server.runner import serve


class FixedCap:
    """A draft cap that always answers ``k`` (stands in for a busy batching server's estimate)."""

    def __init__(self, k: int = 1) -> None:
        self.k = k
        self.asked: list[tuple[str, bool]] = []  # (wire, server_drafted) of every cap() call
        self.values: list[float] = []  # the value of every cap() call
        self.wanted: list[int | None] = []  # the tokens each cap() call's round wanted (None: unknown)
        self.rounds: list[tuple[Any, ...]] = []
        self.drafted: list[int] = []  # observe_drafted() calls: tree rounds' drafted nodes

    def cap(self, wire: str, *, server_drafted: bool = False, value: float = 1.0, wanted: int | None = None) -> int:
        self.asked.append((wire, server_drafted))
        self.wanted.append(wanted)
        self.values.append(value)
        return self.k

    def observe_tokens(self, n: int) -> None:
        pass

    def observe_round(self, *args: Any, **_: Any) -> None:
        self.rounds.append(args)

    def observe_drafted(self, tokens: int) -> None:
        self.drafted.append(tokens)


class LetterTokenizer:
    """Token i <-> the letter 'a' + i: enough of a tokenizer for the OpenAI endpoints on a toy model."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids: Any, **_: Any) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)


class ChatLetters(LetterTokenizer):
    """The letter tokenizer with a chat template: a conversation is its messages' letters."""

    chat_template = "letters"

    def apply_chat_template(self, messages: Any, tokenize: bool = False, add_generation_prompt: bool = True,
                            **_: Any) -> str:
        return "".join(m["content"] for m in messages)


@dataclass(frozen=True)
class ToyApp:
    """Builds the toy serving app (picklable: the Ray Serve tests hand it to every replica)."""

    vocab: int = 4
    order: int = 2
    seed: int = 0
    max_length: int = 512
    api_key: str | None = None
    max_gamma: int = 64
    max_sessions: int = 64

    def __call__(self, session_id_prefix: str = "") -> Any:
        torch.set_num_threads(1)
        target = ToyLM(self.vocab, order=self.order, seed=self.seed)
        target.max_length = self.max_length
        draft = target.perturbed(1.0, seed=1)
        settings = ServerSettings(api_key=self.api_key, model_name="toy", max_sessions=self.max_sessions,
                                  max_gamma=self.max_gamma, session_id_prefix=session_id_prefix)
        return create_app(target, tokenizer=LetterTokenizer(), settings=settings, drafter_factory=lambda: ModelDrafter(draft),
                          drafter_name="toy-draft")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--vocab", type=int, default=4)
    p.add_argument("--order", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--api-key")
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument("--ttl", type=float, default=900.0)
    p.add_argument("--max-gamma", type=int, default=64)
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--header-timeout", type=float, default=10.0)
    p.add_argument("--body-timeout", type=float, default=30.0)
    p.add_argument("--log-level", default="warning")
    args = p.parse_args()
    torch.set_num_threads(1)
    target = ToyLM(args.vocab, order=args.order, seed=args.seed)
    target.max_length = args.max_length
    draft = target.perturbed(1.0, seed=1)
    settings = ServerSettings(
        api_key=args.api_key, model_name="toy", max_sessions=args.max_sessions, session_ttl_s=args.ttl,
        max_gamma=args.max_gamma, max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        # no draft cap: it sizes drafts from measured pass times, so on a loaded test machine it could
        # cap them to nothing and the exactness tests would see no drafting (the cap has its own tests)
        draft_cap=False,
    )
    app = create_app(target, settings=settings, drafter_factory=lambda: ModelDrafter(draft), drafter_name="toy-draft")
    serve(app, host="127.0.0.1", port=args.port, log_level=args.log_level, header_timeout_s=args.header_timeout)


if __name__ == "__main__":
    main()
