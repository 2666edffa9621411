"""The rollout engine: continuous batching over a paged KV cache, chunked prefill, routing capture.

    engine = Engine(model, EngineConfig(max_batch_size=64, max_seq_len=1024))
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=128, temperature=1.0))

Each `step()`: admit waiting requests while their blocks fit (kv_cache.py; the full blocks of their prompt
that another request already computed are shared, not recomputed); run prefill chunks for requests that still
have more than one uncomputed token (one forward per chunk, rows of equal chunk length batched together); run
one decode forward over every request that has exactly one uncomputed token (its last sampled token). New
requests therefore join while others decode. A request's state is its token list plus how many positions are
cached, so a continuation (a prefix from an aborted request) is just a longer prompt whose generated part is
kept, and a request preempted when decode runs out of blocks goes back to the front of the queue as one.

The cache's size comes from the memory plan (memory.py). Decode on CUDA runs as captured CUDA graphs (one per
batch-size bucket) when `cuda_graphs` is on. With `overlap_decode` the next decode step is launched before the
current one's tokens are read, so the host's bookkeeping runs while the device computes (decode_pipeline.py).
"""

from __future__ import annotations

import itertools
import logging
import operator
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from moerl import kernels
from moerl.kernels import use_triton
from moerl.model.transformer import MoECausalLM
from moerl.rollout.block_pool import ROOT
from moerl.rollout.decode_graphs import DecodeBatch, DecodeGraphs
from moerl.rollout.decode_pipeline import DecodePipeline, DecodePlan
from moerl.rollout.engine_config import EngineConfig
from moerl.rollout.kv_cache import PagedKVCache
from moerl.rollout.memory import plan_for_device
from moerl.rollout.sampling import SamplingBatch, SamplingParams, fused_sampler_ok, sample, sampling_hints
from moerl.rollout.types import Completion, StepOutput

log = logging.getLogger(__name__)


@dataclass
class _Request:
    id: str
    params: SamplingParams
    seed: int
    tokens: list[int]  # prompt + generated
    num_prompt: int
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    prefix_routing: torch.Tensor | None = None  # a continuation's (or a preempted request's) routing so far
    num_computed: int = 0  # positions whose keys/values are in the cache
    slot: int = -1  # row of the block table and of the decode batch while running
    blocks: list[int] = field(default_factory=list)  # the KV blocks of its positions, in order
    chain: int | None = ROOT  # prefix cache: content id of its last keyed block (None: keys no more)
    num_keyed: int = 0  # its leading blocks keyed in the prefix cache
    finish_reason: str | None = None
    decodable_from: int = 0  # the step (Engine.steps) from which it may decode: the one after its admission/prefill

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


class Engine:
    def __init__(self, model: MoECausalLM, config: EngineConfig | None = None, *, version: int = 0,
                 group_member: bool = False) -> None:
        """group_member: set by EngineGroup, the one caller that may hand in a model whose experts are split."""
        split = model.moe_blocks[0].dispatcher.world_size if model.moe_blocks else 1
        if split > 1 and not group_member:  # its MoE layers would wait forever for the other ranks' tokens
            raise ValueError(f"this model's experts are split over {split} ranks (built with expert_parallel_group): "
                             "a plain Engine cannot run it; run an EngineGroup (moerl.rollout.EngineGroup) on every "
                             "rank of that group")
        self.model = model.eval()
        self.config = config = config or EngineConfig()
        self._check_config(config)
        self.version = version
        arch = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if use_triton(param):  # compile and check the fused sampler now, never inside a decode graph's capture
            for logits_dtype in {self.dtype, torch.float32}:
                fused_sampler_ok(self.device, logits_dtype)
        weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in model.parameters()}.values())
        self.plan = plan_for_device(arch, config, self.dtype, self.device, weights=weights)
        log.info("rollout engine %s", self.plan.describe())
        self.cache = PagedKVCache(
            num_layers=arch.num_hidden_layers, num_blocks=self.plan.num_blocks + 1, block_size=config.kv_block_size,
            num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, max_rows=config.max_batch_size,
            max_seq_len=config.max_seq_len, moe_layers=model.num_moe_layers, top_k=arch.num_experts_per_tok,
            dtype=self.dtype, device=self.device, prefix_caching=config.prefix_caching)
        if self.cache.decode_kernel:  # checked now, before any decode graph is captured (never inside one)
            self.cache.decode_kernel = kernels.paged_decode_ok(self.device, self.dtype, arch.num_attention_heads,
                                                               arch.num_key_value_heads, arch.head_dim,
                                                               config.kv_block_size)
        self.waiting: list[_Request] = []
        self.running: dict[str, _Request] = {}  # id -> request, in admission order (the newest is preempted first)
        self.by_id: dict[str, _Request] = {}
        self._finished_at_submit: list[_Request] = []  # complete prefixes: the next step() reports them
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self.steps = 0  # step() calls (start_step phases) so far
        width = self.cache.width
        self.graphs = (DecodeGraphs(config.max_batch_size, width, width * config.kv_block_size, self.device,
                                    self.decode_forward)
                       if config.cuda_graphs and self.device.type == "cuda" else None)
        # prefill_tokens: positions computed by prefill; prefix_hit_tokens: positions found in the prefix cache;
        # overlap_steps: decode steps launched before the previous one was read; overlap_discarded: such
        # launches dropped unread (an abort, new weights, all its rows stopped: see decode_pipeline.py)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "decode_steps": 0, "prefix_hit_tokens": 0,
                      "preemptions": 0, "overlap_steps": 0, "overlap_discarded": 0}
        overlap = config.overlap_decode if config.overlap_decode is not None else self.device.type == "cuda"
        self.pipeline = DecodePipeline(self, overlap)

    @staticmethod
    def _check_config(config: EngineConfig) -> None:
        """Refuse settings that would make no progress (a zero prefill budget loops forever) or leave no room."""
        for name, low in (("max_batch_size", 1), ("max_seq_len", 2), ("prefill_chunk", 1), ("max_prefill_tokens", 1),
                          ("kv_block_size", 1), ("kv_cache_tokens", 0)):
            value = getattr(config, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {value!r}")
        if not 0 < config.gpu_memory_fraction <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_fraction must be in (0, 1], got {config.gpu_memory_fraction!r}")

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: Sequence[int], params: SamplingParams, *, request_id: str | None = None,
               prefix: Completion | None = None) -> str:
        """Queue a request; raise ValueError naming the problem (the engine and other requests are unaffected).

        prefix: a partial completion of this prompt (from `abort`, maybe on another engine): generation
        continues after its tokens, keeping their log-probs, routing and versions.
        """
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.by_id:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        prompt = self.check_request(prompt, params, prefix)
        seed = params.seed if params.seed is not None else (
            prefix.seed if prefix is not None and prefix.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen)))
        req = _Request(request_id, params, seed, prompt + (list(prefix.token_ids) if prefix else []), len(prompt))
        if prefix is not None:
            req.generated, req.logprobs, req.versions = list(prefix.token_ids), list(prefix.logprobs), list(prefix.versions)
            if prefix.routed_experts is not None and prefix.routed_experts.shape[0]:
                req.prefix_routing = prefix.routed_experts.to(torch.int16)
        self.by_id[request_id] = req
        if self._check_finished(req):  # a prefix that already reached its end
            self._finished_at_submit.append(req)
        else:
            self.waiting.append(req)
        return request_id

    def check_request(self, prompt: Sequence[int], params: SamplingParams,
                      prefix: Completion | None = None) -> list[int]:
        """The prompt as a list of ints, or ValueError naming what `submit` would refuse."""
        prompt = _token_ids(prompt)
        self._validate(prompt, params, prefix)
        return prompt

    def _validate(self, prompt: list[int], params: SamplingParams, prefix: Completion | None) -> None:
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.config.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room to generate: "
                             f"max_seq_len is {self.config.max_seq_len}")
        params.validate(vocab)
        if prefix is not None:
            if list(prefix.prompt_token_ids) != prompt:
                raise ValueError("prefix.prompt_token_ids differ from the prompt it is meant to continue")
            n = len(prefix.token_ids)
            if not (len(prefix.logprobs) == len(prefix.versions) == n):
                raise ValueError(f"prefix has {n} tokens but {len(prefix.logprobs)} log-probs and "
                                 f"{len(prefix.versions)} versions")
            bad = [t for t in prefix.token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prefix token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            routing = prefix.routed_experts
            if routing is not None:
                arch = self.model.config
                L, K, E = self.model.num_moe_layers, arch.num_experts_per_tok, arch.num_experts
                most = len(prompt) + n - 1
                if (not isinstance(routing, torch.Tensor) or routing.dim() != 3 or tuple(routing.shape[1:]) != (L, K)
                        or routing.shape[0] > most):
                    shape = list(routing.shape) if isinstance(routing, torch.Tensor) else type(routing).__name__
                    raise ValueError(f"prefix.routed_experts is {shape}; this model needs [positions <= {most}, "
                                     f"moe_layers={L}, top_k={K}]")
                if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) >= E):
                    raise ValueError(f"prefix.routed_experts holds expert ids outside [0, {E})")

    def abort(self, request_id: str) -> Completion:
        """Stop a request now and return its partial completion (finish_reason "abort")."""
        req = self.by_id.get(request_id)
        if req is None:
            raise KeyError(f"no request {request_id!r} in the engine")
        self.pipeline.forget(req)  # a step launched ahead for it is waited for before its blocks are freed
        req.finish_reason = req.finish_reason or "abort"
        return self._release(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_at_submit)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copy new weights into the model in place (CUDA graphs keep their addresses); later tokens carry
        `version`. Keys/values already cached stay: a running request continues on its existing cache."""
        state = self.model.state_dict()
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        # Check every tensor before copying any: a refused update leaves the model as it was.
        for name, tensor in items:
            if name not in state:
                raise KeyError(f"update_weights: unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(f"update_weights: {name!r} has shape {list(tensor.shape)}, "
                                 f"the model's is {list(state[name].shape)}")
        self.pipeline.drain()  # no step in flight reads half-copied weights; one launched ahead ran the old ones
        for name, tensor in items:
            state[name].copy_(tensor)
        self.version = version
        self.cache.forget_prefixes(self.running.values())  # cached prompts were computed by the old weights

    # ------------------------------------------------------------------ driving
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 prefixes: Sequence[Completion | None] | None = None) -> list[Completion]:
        """Run the prompts to completion. A request that is refused comes back with finish_reason "error"."""
        return run_to_completion(self.submit, self.step, self.has_unfinished, prompts, params, prefixes)

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One scheduling step: admit, prefill chunks, one decode forward. Returns per-request deltas.

        Written as phases (start_step, prefill_batches/run_prefill, decode_batch/run_decode, finish) so that an
        expert-parallel engine group (engine_group.py) can run the same step with its forwards in lockstep.
        A request whose prefill ends in a step (sampling its first token) decodes from the next step on: every
        decode step's rows are then fixed when the step before it is planned (decode_pipeline.py), with or
        without overlap_decode."""
        outputs = self.start_step()
        for n, reqs in self.prefill_batches():
            self.run_prefill(reqs, n, outputs)
        self.finish(outputs)  # before decode: their blocks are free for it, and no finished request is preempted
        reqs = self.decode_batch()
        if reqs:
            self.run_decode(reqs, outputs)
        self.finish(outputs)
        return list(outputs.values())

    def start_step(self) -> dict[str, StepOutput]:
        """Admit waiting requests; the outputs of this step so far (requests that finished at submit)."""
        self.steps += 1
        self._admit()
        outputs: dict[str, StepOutput] = {}
        finished, self._finished_at_submit = self._finished_at_submit, []
        for req in finished:
            outputs[req.id] = StepOutput(req.id, [], [], self._release(req))
        return outputs

    def finish(self, outputs: dict[str, StepOutput]) -> None:
        """Release the running requests that finished, into `outputs`."""
        for req in [r for r in self.running.values() if r.finish_reason]:
            outputs.setdefault(req.id, StepOutput(req.id, [], [])).completion = self._release(req)

    def _admit(self) -> None:
        free = sorted(set(range(self.config.max_batch_size)) - {r.slot for r in self.running.values()})
        batch = self.config.admit_batch or max(1, self.config.max_batch_size // 8)
        if self.running and len(free) < min(batch, len(self.waiting)):
            return  # decode on; admit together once enough slots are free
        for req in list(self.waiting):
            if not free:
                break
            req.slot = free[0]  # lowest free row: keeps the decode batch a short contiguous range
            verdict = self.cache.admit(req)
            if verdict == "full":  # first come, first served: no later request overtakes it
                req.slot = -1
                break
            if verdict == "wait":  # its prompt's blocks are being computed: share them once they are
                req.slot = -1
                continue
            free.pop(0)
            self.waiting.remove(req)
            self.running[req.id] = req
            req.decodable_from = self.steps + 1  # even with its whole prompt cached: see step()
            self.stats["prefix_hit_tokens"] += req.num_computed

    def prefill_batches(self) -> list[tuple[int, list[_Request]]]:
        """This step's prefill forwards: (chunk length n, requests) per forward, within max_prefill_tokens."""
        budget = self.config.max_prefill_tokens
        todo = [r for r in self.running.values() if r.pending > 1 or r.num_computed == 0]
        groups: dict[int, list[_Request]] = {}
        for req in todo:
            n = min(self.config.prefill_chunk, req.pending, budget)
            if n <= 0:
                break
            budget -= n
            groups.setdefault(n, []).append(req)
        return list(groups.items())

    def run_prefill(self, reqs: list[_Request], n: int, outputs: dict[str, StepOutput]) -> None:
        """One prefill forward: the next n tokens of each of reqs."""
        dev = self.device
        pos_BT = torch.tensor([r.num_computed for r in reqs])[:, None] + torch.arange(n)[None, :]
        ids_BT = torch.tensor([r.tokens[r.num_computed: r.num_computed + n] for r in reqs], device=dev)
        slots = [r.slot for r in reqs]
        plan = self.cache.prefill_plan(slots, pos_BT)
        out = self.forward(ids_BT, position_ids_BT=pos_BT.to(dev), kv_caches=self.cache.views(plan),
                           last_logits_only=True)
        self.cache.store_routing(slots, pos_BT, out.routed_experts_BTLK.to(torch.int16).cpu())
        for req in reqs:
            req.num_computed += n
            req.decodable_from = self.steps + 1  # see step(): a prefilled request decodes from the next step
            self.cache.computed(req, req.num_computed - n)
        self.stats["prefill_tokens"] += n * len(reqs)
        ready = [i for i, r in enumerate(reqs) if r.pending == 0]
        if ready:
            idx = torch.tensor(ready, device=dev)
            self._sample_and_append([reqs[i] for i in ready], out.logits_BTV[idx, -1], outputs)

    def decode_batch(self) -> list[_Request]:
        """The requests this step decodes (one uncomputed token each), with a block for their next position
        (making room may preempt the newest running requests)."""
        return self.pipeline.decode_batch()

    def run_decode(self, reqs: list[_Request], outputs: dict[str, StepOutput]) -> None:
        """One decode forward over reqs (not empty): sample each one's next token (overlapped: the next step is
        launched before this one's tokens are read; decode_pipeline.py)."""
        self.pipeline.run_decode(reqs, outputs)

    def _make_room(self, reqs: list[_Request]) -> list[_Request]:
        """A block for each decoding request's next position, oldest request first; when none is free, preempt
        the newest running request (it is recomputed later) until the older ones fit. Returns those that stay."""
        for req in reqs:
            while req.id in self.running and not self.cache.grow(req):
                self._preempt(next(reversed(self.running.values())))
        return [r for r in reqs if r.id in self.running]

    def _preempt(self, req: _Request) -> None:
        """Free req's blocks and put it back at the front of the queue as a continuation of its own tokens: its
        sampled tokens, log-probs, versions and routing so far are kept, and its seed keys the same noise."""
        self.pipeline.forget(req)
        req.prefix_routing = self._routing(req)
        del self.running[req.id]
        self.cache.free(req)
        req.slot = -1
        self.waiting.insert(0, req)
        self.stats["preemptions"] += 1

    def decode_inputs(self, source: list[_Request] | DecodePlan, batch: DecodeBatch) -> None:
        """Fill a padded decode batch from requests whose last token is on the host, or from a plan whose input
        ids are the previous step's sampled ids, still on the device (what the pipeline calls before a launch)."""
        if isinstance(source, DecodePlan):
            batch.fill_next(source, self.cache.table_RW, self.pipeline.staging)
        else:
            batch.fill(source, self.cache.table_RW, self.pipeline.staging)

    def decode_forward(self, batch: DecodeBatch, kv_len: int, hints: dict | None = None):
        """The decode computation: a forward over a padded batch, then sampling (what the graphs capture)."""
        plan = self.cache.decode_plan(batch.pos_B, batch.table_BW, kv_len)
        out = self.forward(batch.ids_B[:, None], position_ids_BT=batch.pos_B[:, None],
                           kv_caches=self.cache.views(plan))
        token_B, logprob_B = sample(out.logits_BTV[:, -1], batch.sampling, **(hints or {}),
                                    vocab_limit=self.config.vocab_limit)
        return token_B, logprob_B, out.routed_experts_BTLK[:, 0]

    @torch.no_grad()
    def forward(self, ids_BT: torch.Tensor, **kwargs):
        """Every forward of the engine goes through here, so none records autograd whoever drives the engine
        (step, an engine group's phases, a decode graph's capture): a recorded graph would keep every step's
        activations alive (a dropped decorator once grew memory ~9 GB per 400 decode steps)."""
        return self.model.forward_full(ids_BT, **kwargs)

    def _sample_and_append(self, reqs: list[_Request], logits_BV: torch.Tensor, outputs) -> None:
        sampling = SamplingBatch.empty(len(reqs), self.device)
        sampling.set_rows(list(range(len(reqs))), [r.params for r in reqs], [r.seed for r in reqs],
                          [len(r.tokens) for r in reqs])
        token_B, logprob_B = sample(logits_BV, sampling, **sampling_hints(reqs), vocab_limit=self.config.vocab_limit)
        for r, tok, lp in zip(reqs, token_B.tolist(), logprob_B.tolist()):
            self._append(r, tok, lp, outputs)

    def _append(self, req: _Request, token: int, logprob: float, outputs: dict[str, StepOutput],
                version: int | None = None) -> None:
        """version: of the weights that computed the token (a decode step's own, recorded at its launch)."""
        req.tokens.append(token)
        req.generated.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version if version is None else version)
        out = outputs.setdefault(req.id, StepOutput(req.id, [], []))
        out.new_token_ids.append(token)
        out.new_logprobs.append(logprob)
        self._check_finished(req)

    def _check_finished(self, req: _Request) -> bool:
        p = req.params
        if req.generated and len(req.generated) > p.min_new_tokens and req.generated[-1] in p.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.generated) >= p.max_new_tokens or len(req.tokens) >= self.config.max_seq_len:
            req.finish_reason = "length"
        return req.finish_reason is not None

    def _release(self, req: _Request) -> Completion:
        self.by_id.pop(req.id, None)
        if req in self.waiting:
            self.waiting.remove(req)
        self._finished_at_submit = [r for r in self._finished_at_submit if r is not req]
        routing = self._routing(req)
        if self.running.pop(req.id, None) is not None:
            self.cache.free(req)
        completion = Completion(req.id, req.tokens[: req.num_prompt], list(req.generated), list(req.logprobs),
                                list(req.versions), routing, req.finish_reason, seed=req.seed)
        if self.config.deterministic and completion.token_ids and req.finish_reason != "abort":
            self._rescore(completion, req)
        return completion

    def _routing(self, req: _Request) -> torch.Tensor:
        """The experts at every position req ran: a continuation's own routing where it brings it (the policy
        that sampled those tokens chose it), the cache's record of the positions computed here after that."""
        prefix = req.prefix_routing
        n_prefix = 0 if prefix is None else prefix.shape[0]
        if req.num_computed <= n_prefix:
            table = self.cache.routing_NPLK
            return prefix if prefix is not None else table.new_zeros(0, *table.shape[2:])
        routing = self.cache.routing_of(req, req.num_computed)
        if n_prefix:
            routing[:n_prefix] = prefix
        return routing

    @torch.no_grad()
    def _rescore(self, completion: Completion, req: _Request) -> None:
        """Deterministic mode: log-probs and routing from one full forward over the positions the engine ran,
        the function the trainer computes, so they agree bitwise (see docs/rollout.md)."""
        inputs = torch.tensor([req.tokens[:-1]], device=self.device)
        out = self.forward(inputs)
        temp = req.params.temperature or 1.0
        logp_TV = torch.log_softmax(out.logits_BTV[0, req.num_prompt - 1:].float() / temp, dim=-1)
        targets = torch.tensor(req.generated, device=self.device)
        completion.logprobs = logp_TV.gather(1, targets[:, None]).squeeze(1).tolist()
        completion.routed_experts = out.routed_experts_BTLK[0].to(torch.int16).cpu()


def run_to_completion(submit, step, unfinished, prompts: Sequence[Sequence[int]],
                      params: SamplingParams | Sequence[SamplingParams],
                      prefixes: Sequence[Completion | None] | None = None) -> list[Completion]:
    """Submit every prompt, step while `unfinished()`, and return one Completion per prompt in order (a refused
    request comes back with finish_reason "error"). Requests complete at submit are reported by the next step.
    Engine.generate and EngineGroup.generate (whose `unfinished` asks every rank) both run this."""
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    ids: list[str | Completion] = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(submit(prompt, params_list[i], prefix=prefixes[i] if prefixes else None))
        except ValueError as e:
            ids.append(Completion(f"error-{i}", list(prompt), finish_reason="error", error=str(e)))
    done: dict[str, Completion] = {}
    while unfinished():
        for out in step():
            if out.completion is not None:
                done[out.request_id] = out.completion
    return [i if isinstance(i, Completion) else done[i] for i in ids]


def _token_ids(tokens: Sequence[int]) -> list[int]:
    """Python ints from any sequence of integers (list, numpy array, tensor); ValueError for anything else."""
    out, bad = [], []
    for t in tokens:
        try:
            out.append(operator.index(t))
        except TypeError:
            bad.append(t)
    if bad:
        raise ValueError(f"prompt token ids must be integers, got {bad[:5]}")
    return out
