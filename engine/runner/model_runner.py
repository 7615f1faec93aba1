"""Runs the model for one scheduled step and samples: the only place that touches the KV cache tensors.

Called by ``LLMEngine.step``:  ``sampled = runner.execute(scheduler_output)``  ->  ``{request_id: SampleResult}``.
A tensor/pipeline-parallel worker rank (``pdserve.engine.parallel.stage``) owns one too, for its
KV cache shard and ``sample_requests``.
Owns the paged KV cache (allocated once from the ``KVLayout``), the per-request draw counters of seeded sampling (``seeded.py``)
and the sampler call (with the output-token counts of penalised requests: their input-batch rows, or
counted from the ids a worker rank's step message carries); on CUDA the decode graphs (``cuda_graphs.py``),
on CPU the compiled layer pieces (``compile.py``), both built at start-up and skipped under ``--enforce-eager``;
on CUDA, first, every Triton kernel a request can need (``kernel_warmup.py``: the attention variants with the
Triton backend, the fused norm / rope and KV transfer kernels with any).
A step in which a request asks for prompt logprobs runs every row (``prompt_logprobs.py``); ``LLMEngine.step``
reads what it computed from ``runner.prompt_logprobs`` after ``execute``.
"""

from __future__ import annotations

import torch

from pdserve.engine.kv.kv_layout import KVLayout
from pdserve.engine.kv.layer_hooks import HookChain
from pdserve.engine.models.llama import LogitRows
from pdserve.engine.runner.decode_splits import DecodeSplits
from pdserve.engine.runner.input_batch import InputBatch
from pdserve.engine.runner.output_counts import CountsPlan
from pdserve.engine.runner.penalties import counts_plan_from_ids
from pdserve.engine.runner.prompt_logprobs import plan_prompt_rows, prompt_logprobs
from pdserve.engine.runner.sampler import generator_draws, sample
from pdserve.engine.structured.bitmask import apply_bitmask
from pdserve.kernels import cpu_attention, cpu_ops, resolve_backend


class SampleFailure:
    """In place of a ``SampleResult``: sampling this request raised; ``message`` says why."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class ModelRunner:
    def __init__(self, model, layout: KVLayout, num_blocks: int, block_size: int, device: str = "cpu",
                 max_num_seqs: int = 64, max_model_len: int = 4096, attention_backend: str | None = None,
                 enforce_eager: bool = True, torch_compile: bool = False):
        self.model = model
        self.layout = layout
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_caches = layout.allocate(num_blocks, block_size, self.device)   # per layer {k, v}: [N, bs, Hkv, D]
        self.attention_backend = resolve_backend(attention_backend, self.device.type)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, block_size, self.device, self.attention_backend)
        self._draws: dict[str, int] = {}       # seeded request id -> draws made so far (here and before it came)
        self.decode_splits = DecodeSplits(max_num_seqs, max_model_len, layout.num_kv_heads)   # Triton decode steps
        if self.device.type == "cuda":
            from pdserve.engine.runner.kernel_warmup import warm_up

            warm_up(self)                   # every Triton kernel a request can need: attention, norm, rope, KV I/O, MoE
        self.graphs = None                  # DecodeGraphs on CUDA unless --enforce-eager (cuda_graphs.py)
        if self.device.type == "cuda" and not enforce_eager:
            from pdserve.engine.runner.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs.capture(self, max_model_len)
            if self.graphs is not None:                 # decode steps are staged straight into its buffers
                self.input_batch.staging.graph_inputs = self.graphs.inputs
        self.compiled = None                # CompiledLayers when torch_compile (compile.py: CPU, one process)
        if torch_compile and getattr(model, "supports_compile", True):
            from pdserve.engine.runner.compile import compile_layers

            self.compiled = compile_layers(model)
        self.keep_sampled_rows = self._rows_keep_their_bits()     # LogitRows: see _forward
        self.prompt_logprobs: dict = {}     # the last step's {request_id: (first index, [PromptLogprob])}

    @torch.inference_mode()
    def execute(self, scheduler_output) -> dict:
        for req in (*scheduler_output.preempted, *scheduler_output.rejected):
            self.input_batch.remove(req.request_id)       # their blocks are gone; a rerun starts a new row
        scheduled = scheduler_output.scheduled
        self.prompt_logprobs = {}
        if not scheduled:
            return {}
        inputs = self.prepare(scheduled)
        inputs.attn.layer_hooks = HookChain.of(getattr(scheduler_output, "load_hooks", None),
                                               getattr(scheduler_output, "kv_publish_hooks", None))
        plan = plan_prompt_rows(scheduled)
        eager = plan is not None or inputs.attn.layer_hooks is not None      # a graph calls no hooks
        hidden = self.graphs.run(inputs) if self.graphs is not None and not eager else None   # decode: replay
        if hidden is not None:
            hidden = hidden[inputs.sample_rows]
        elif plan is not None:
            every = self._forward(inputs, every_row=True)                                     # [T, D]
            self.prompt_logprobs = prompt_logprobs(self.model, every, plan)
            hidden = every[inputs.sample_rows]
        else:
            hidden = self._forward(inputs)                                                    # [S, D]
        if not inputs.sample_requests:
            return {}
        logits = self.model.compute_logits(hidden)                                            # [S, V]
        return self.sample_requests(logits, inputs.sample_requests,
                                    getattr(scheduler_output, "grammar_bitmask", None))

    def prepare(self, scheduled):
        """The step's ``StepInputs`` (``input_batch.py``); a decode step on the Triton backend gets the split-K
        count of its CUDA-graph bucket whether it replays or runs eagerly (``decode_splits.py``)."""
        inputs = self.input_batch.prepare(scheduled)
        self.decode_splits.apply(inputs.attn)
        return inputs

    def _forward(self, inputs, every_row: bool = False) -> torch.Tensor:
        """The hidden states of the sampled rows, [S, D] (``every_row``: of every row, [T, D]). Where
        ``keep_sampled_rows`` holds, an eager step with rows that are not sampled (prompt chunks) runs its last
        layer's attention and MLP for the sampled rows only (``LogitRows``: the same bits for them, less work);
        other steps run every row and pick."""
        n, rows = inputs.input_ids.shape[0], inputs.sample_rows
        pieces = self.compiled.pieces_for(n) if self.compiled is not None else None
        if self.keep_sampled_rows and pieces is None and rows.numel() < n and not every_row:
            keep = LogitRows(rows, inputs.attn.for_rows(rows))
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn, logit_rows=keep)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn, pieces=pieces)
        return hidden if every_row else hidden[rows]

    def _rows_keep_their_bits(self) -> bool:
        """Whether the last layer may run for the sampled rows only and give each the bits of the full step:
        the ``cpu`` attention kernel on a cache it takes (else the torch reference runs, whose decode and
        prefill paths round differently), the C RMSNorm, and fp32 matmuls on oneDNN with the few-row panels
        (``DecoderLayer.rows_independent``). Compiled steps keep the full step too (``_forward``): compiled
        and eager pieces round differently."""
        model = self.model
        if self.attention_backend != "cpu" or not getattr(model, "is_last", False) or not self.kv_caches:
            return False
        keep = (cpu_attention.supports(self.kv_caches[-1]) and cpu_ops.load() is not None
                and model.layers[-1].rows_independent())
        if keep:
            model.layers[-1].attn.split_qkv()         # its Q/KV parts, checked and copied now, not in a request
        return keep

    def sample_requests(self, logits: torch.Tensor, reqs: list, grammar_bitmask=None) -> dict:
        """logits: [S, V] of ``reqs`` (anything with request_id, sampling_params, all_token_ids,
        banned_token_ids and sampler_draws, like ``Request``; output_token_ids when penalised and not in the
        input batch) -> {request_id: SampleResult}.
        ``grammar_bitmask`` (a ``GrammarBitmask``): structured requests' allowed tokens, applied to ``logits``
        in place first (one pass over the batch); the sampler then sees -inf at every other token.

        One request's bad parameters (a token id outside the vocabulary) fail that request only: its entry is
        a ``SampleFailure`` and the others get their tokens. If the batch raises, each request is sampled alone
        (a seeded request's draw count moves only once its token is taken).
        """
        apply_bitmask(logits, [r.request_id for r in reqs], grammar_bitmask)
        try:
            return self._sample(logits, reqs)
        except Exception:  # noqa: BLE001 - find the culprit(s) row by row (the rare path)
            out = {}
            for i, r in enumerate(reqs):
                try:
                    out.update(self._sample(logits[i:i + 1], [r]))
                except Exception as exc:  # noqa: BLE001 - that request fails, nobody else does
                    out[r.request_id] = SampleFailure(f"sampling failed: {type(exc).__name__}: {exc}")
            return out

    def _sample(self, logits: torch.Tensor, reqs: list) -> dict:
        draws = [self._draws.get(r.request_id, r.sampler_draws) for r in reqs]
        results = sample(logits, [r.sampling_params for r in reqs], draws, _histories(reqs), _banned(reqs),
                         counts=self._output_counts(reqs, logits.shape[1]))
        for r, made in zip(reqs, draws):
            if generator_draws(r.sampling_params, 1):
                self._draws[r.request_id] = made + 1
        return {r.request_id: res for r, res in zip(reqs, results)}

    def _output_counts(self, reqs: list, vocab: int) -> CountsPlan | None:
        """The [M, V] generated-token counts of the penalised ``reqs``, in order, as a ``CountsPlan`` (its host half
        rides in the sampler's one packed copy): from their input-batch rows, or counted from their output ids
        when the batch holds no row for them (a worker rank's step message)."""
        penalised = [r for r in reqs if r.sampling_params.penalised]
        if not penalised:
            return None
        rows = [self.input_batch.rows.get(r.request_id) for r in penalised]
        if None not in rows:
            return self.input_batch.output_counts.plan(rows, vocab)
        return counts_plan_from_ids([list(r.output_token_ids) for r in penalised], vocab, self.device)

    def release(self, request_id: str) -> None:
        """Forget per-request state once the request finished or was aborted."""
        self._draws.pop(request_id, None)
        self.input_batch.remove(request_id)


def _histories(reqs) -> list[list[int]] | None:
    if all(r.sampling_params.repetition_penalty == 1.0 for r in reqs):
        return None
    return [r.all_token_ids for r in reqs]


def _banned(reqs) -> list[list[int]] | None:
    """min_tokens (vLLM semantics): until reached, eos and stop_token_ids cannot be sampled."""
    banned = [list(r.banned_token_ids) for r in reqs]
    return banned if any(banned) else None
