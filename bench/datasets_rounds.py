"""Datasets played in rounds: round r starts after every request of round r-1 has ended.

Called through ``datasets.sample_requests``. Both reuse long prefixes on purpose, to measure
prefix caching and the KV store.

multi-round's history (``--multi-round-history``):
  synthetic   (default) the answers in the history are fixed-seed tokens, so the workload is the same text on
              every server, whatever it answers
  generated   each round's prompt is the previous round's prompt + the answer the server streamed + the new
              question, as a chat client sends it and as LMCache's multi-round QA benchmark builds its history
              (run it greedy, ``--temperature 0``, for the same workload on two servers); the runner threads it
              (``runner.py``): the dataset gives round 0's prompt and, for later rounds, the question (``turn``)

multi-round (LMCache's multi-round QA shape), user u, round r:

    [ system (shared by all users) | q(u,0) a(u,0) | q(u,1) a(u,1) | ... | q(u,r) ]   -> answer_len tokens

long-doc, document d, round r (round 0 cold, later rounds warm):

    [ doc(d) | question(d,r) ]   -> output_len tokens
"""

from __future__ import annotations

import dataclasses

from pdserve.bench.dataset_base import DatasetConfig, SampleRequest, TokenSource

HISTORIES = ("synthetic", "generated")


def multi_round_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    if cfg.multi_round_users < 1 or cfg.multi_round_rounds < 1:
        raise ValueError(f"--multi-round-users {cfg.multi_round_users} and --multi-round-rounds "
                         f"{cfg.multi_round_rounds} must be >= 1")
    if cfg.multi_round_history not in HISTORIES:
        raise ValueError(f"--multi-round-history {cfg.multi_round_history!r} must be one of {', '.join(HISTORIES)}")
    src = TokenSource(tokenizer, cfg.seed)
    system = src.tokens(cfg.multi_round_system_len)
    history = [list(system) for _ in range(cfg.multi_round_users)]
    generated = cfg.multi_round_history == "generated"
    out = []
    for r in range(cfg.multi_round_rounds):
        for u in range(cfg.multi_round_users):
            question = src.tokens(cfg.multi_round_question_len)
            head = src.tokenizer.decode(history[u]) if generated else ""
            history[u] += question
            req = src.request(history[u], cfg.multi_round_answer_len, r)
            if generated:
                req = dataclasses.replace(req, session=u, turn=_added_text(req.prompt, head, src, question))
            out.append(req)
            history[u] += src.tokens(cfg.multi_round_answer_len)
    return out


def long_doc_requests(cfg: DatasetConfig, tokenizer) -> list[SampleRequest]:
    if cfg.long_doc_num_docs < 1 or cfg.long_doc_rounds < 1:
        raise ValueError(f"--long-doc-num-docs {cfg.long_doc_num_docs} and --long-doc-rounds "
                         f"{cfg.long_doc_rounds} must be >= 1")
    src = TokenSource(tokenizer, cfg.seed)
    docs = [src.tokens(cfg.long_doc_len) for _ in range(cfg.long_doc_num_docs)]
    return [src.request(doc + src.tokens(cfg.long_doc_question_len), cfg.long_doc_output_len, r)
            for r in range(cfg.long_doc_rounds) for doc in docs]


def _added_text(prompt: str, head: str, src: TokenSource, question: list[int]) -> str:
    """The text the question adds after the history: decoded with it, so a tokenizer that drops a sequence's
    leading space (SentencePiece's Metaspace) keeps the space between the answer and the question."""
    return prompt[len(head):] if prompt.startswith(head) else src.to_text(question)[0]
