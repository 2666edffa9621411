"""The rollout engine: continuous batching over a slab KV cache, chunked prefill, routing capture.

    engine = Engine(model, EngineConfig(max_batch_size=64, max_seq_len=1024))
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=128, temperature=1.0))

Each `step()`: admit waiting requests into free cache slots; run prefill chunks for requests that still have
more than one uncomputed token (one forward per chunk, rows of equal chunk length batched together); run one
decode forward over every request that has exactly one uncomputed token (its last sampled token). New requests
therefore join while others decode. A request's state is its token list plus how many positions are cached, so
a continuation (a prefix from an aborted request) is just a longer prompt whose generated part is kept.

Decode on CUDA runs as captured CUDA graphs (one per batch-size bucket) when `cuda_graphs` is on.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from moerl.kernels import use_triton
from moerl.model.transformer import MoECausalLM
from moerl.rollout.decode_graphs import DecodeGraphs
from moerl.rollout.kv_cache import ForwardPlan, SlabKVCache
from moerl.rollout.sampling import SamplingBatch, SamplingParams, fused_sampler_ok, sample, sampling_hints
from moerl.rollout.types import Completion, StepOutput


@dataclass
class EngineConfig:
    max_batch_size: int = 64  # cache slots = requests decoding at once
    max_seq_len: int = 2048  # prompt + generated tokens per request
    prefill_chunk: int = 512  # tokens of one request per prefill forward
    max_prefill_tokens: int = 4096  # prefill tokens per step, so decode keeps running while prompts arrive
    cuda_graphs: bool = True  # capture decode in CUDA graphs (CUDA only)
    # Admit waiting requests once this many slots are free (or all that wait fit), 0 = max_batch_size // 8:
    # a prefill is an eager forward over the whole model, so admitting one request per step as others finish
    # would put one in nearly every decode step (measured: 3.1k tok/s instead of ~14k at 256 slots on an H200).
    admit_batch: int = 0
    deterministic: bool = False  # report log-probs/routing from one full forward (bitwise = the trainer's)
    seed: int = 0  # draws the seed of requests that bring none


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
    prefix_routing: torch.Tensor | None = None  # a continuation's routing, copied into the slot at admission
    num_computed: int = 0  # positions whose keys/values are in the cache
    num_routed: int = 0  # positions whose routing is recorded (a continuation brings some)
    slot: int = -1
    finish_reason: str | None = None

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.num_computed


class Engine:
    def __init__(self, model: MoECausalLM, config: EngineConfig | None = None, *, version: int = 0) -> None:
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
        self.cache = SlabKVCache(arch.num_hidden_layers, config.max_batch_size, config.max_seq_len,
                                 arch.num_key_value_heads, arch.head_dim, self.dtype, self.device)
        # Host-side routing table: the experts chosen at each position of each slot's request.
        self.routing = torch.zeros(config.max_batch_size, config.max_seq_len, model.num_moe_layers,
                                   arch.num_experts_per_tok, dtype=torch.int16)
        self.waiting: list[_Request] = []
        self.running: dict[int, _Request] = {}  # slot -> request
        self.by_id: dict[str, _Request] = {}
        self._finished_at_submit: list[_Request] = []  # complete prefixes: the next step() reports them
        self._ids = itertools.count()
        self._seed_gen = torch.Generator().manual_seed(config.seed)
        self.graphs = (DecodeGraphs(self.cache, config.max_batch_size, self.decode_inputs, self.decode_forward)
                       if config.cuda_graphs and self.device.type == "cuda" else None)
        self.stats = {"prefill_tokens": 0, "decode_tokens": 0, "decode_steps": 0}

    @staticmethod
    def _check_config(config: EngineConfig) -> None:
        """Refuse settings that would make no progress (a zero prefill budget loops forever) or leave no room."""
        for name, low in (("max_batch_size", 1), ("max_seq_len", 2), ("prefill_chunk", 1), ("max_prefill_tokens", 1)):
            value = getattr(config, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"EngineConfig.{name} must be an integer >= {low}, got {value!r}")

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
        prompt = _token_ids(prompt)
        self._validate(prompt, params, prefix)
        seed = params.seed if params.seed is not None else (
            prefix.seed if prefix is not None and prefix.seed is not None
            else int(torch.randint(0, 2**62, (1,), generator=self._seed_gen)))
        req = _Request(request_id, params, seed, prompt + (list(prefix.token_ids) if prefix else []), len(prompt))
        if prefix is not None:
            req.generated, req.logprobs, req.versions = list(prefix.token_ids), list(prefix.logprobs), list(prefix.versions)
            if prefix.routed_experts is not None and prefix.routed_experts.shape[0]:
                req.prefix_routing = prefix.routed_experts.to(torch.int16)
                req.num_routed = prefix.routed_experts.shape[0]
        self.by_id[request_id] = req
        if self._check_finished(req):  # a prefix that already reached its end
            self._finished_at_submit.append(req)
        else:
            self.waiting.append(req)
        return request_id

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
        for name, tensor in items:
            state[name].copy_(tensor)
        self.version = version

    # ------------------------------------------------------------------ driving
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams],
                 prefixes: Sequence[Completion | None] | None = None) -> list[Completion]:
        """Run the prompts to completion. A request that is refused comes back with finish_reason "error"."""
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids: list[str | Completion] = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.submit(prompt, params_list[i], prefix=prefixes[i] if prefixes else None))
            except ValueError as e:
                ids.append(Completion(f"error-{i}", list(prompt), finish_reason="error", error=str(e)))
        done: dict[str, Completion] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.completion is not None:
                    done[out.request_id] = out.completion
        for rid in [i for i in ids if isinstance(i, str) and i in self.by_id]:  # finished at submit
            done[rid] = self._release(self.by_id[rid])
        return [i if isinstance(i, Completion) else done[i] for i in ids]

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """One scheduling step: admit, prefill chunks, one decode forward. Returns per-request deltas."""
        self._admit()
        outputs: dict[str, StepOutput] = {}
        finished, self._finished_at_submit = self._finished_at_submit, []
        for req in finished:
            outputs[req.id] = StepOutput(req.id, [], [], self._release(req))
        self._prefill(outputs)
        self._decode(outputs)
        for req in [r for r in self.running.values() if r.finish_reason]:
            outputs.setdefault(req.id, StepOutput(req.id, [], [])).completion = self._release(req)
        return list(outputs.values())

    def _admit(self) -> None:
        free = sorted(set(range(self.config.max_batch_size)) - set(self.running))
        batch = self.config.admit_batch or max(1, self.config.max_batch_size // 8)
        if self.running and len(free) < min(batch, len(self.waiting)):
            return  # decode on; admit together once enough slots are free
        while self.waiting and free:
            req = self.waiting.pop(0)
            req.slot = free.pop(0)  # lowest free slot: keeps the decode batch a short contiguous range
            self.running[req.slot] = req
            if req.prefix_routing is not None:
                self.routing[req.slot, : req.num_routed] = req.prefix_routing

    def _prefill(self, outputs: dict[str, StepOutput]) -> None:
        budget = self.config.max_prefill_tokens
        todo = [r for r in self.running.values() if r.pending > 1 or r.num_computed == 0]
        groups: dict[int, list[_Request]] = {}
        for req in todo:
            n = min(self.config.prefill_chunk, req.pending, budget)
            if n <= 0:
                break
            budget -= n
            groups.setdefault(n, []).append(req)
        for n, reqs in groups.items():
            self._prefill_group(reqs, n, outputs)

    def _prefill_group(self, reqs: list[_Request], n: int, outputs: dict[str, StepOutput]) -> None:
        dev = self.device
        starts = torch.tensor([r.num_computed for r in reqs], device=dev)
        pos_BT = starts[:, None] + torch.arange(n, device=dev)[None, :]
        ids_BT = torch.tensor([r.tokens[r.num_computed: r.num_computed + n] for r in reqs], device=dev)
        kv_len = int(starts.max()) + n
        key_S = torch.arange(kv_len, device=dev)
        mask = (key_S[None, None, :] <= pos_BT[:, :, None]).unsqueeze(1)
        slots = torch.tensor([r.slot for r in reqs], device=dev)
        plan = ForwardPlan(slots, pos_BT, slots, kv_len, mask)
        out = self.model.forward_full(ids_BT, position_ids_BT=pos_BT, kv_caches=self.cache.views(plan),
                                      attn_mask=mask, last_logits_only=True)
        routing = out.routed_experts_BTLK.to(torch.int16).cpu()
        for i, req in enumerate(reqs):
            skip = max(0, req.num_routed - req.num_computed)  # a continuation's prefix covers these
            if skip < n:
                self.routing[req.slot, req.num_computed + skip: req.num_computed + n] = routing[i, skip:]
                req.num_routed = req.num_computed + n
            req.num_computed += n
        self.stats["prefill_tokens"] += n * len(reqs)
        ready = [i for i, r in enumerate(reqs) if r.pending == 0]
        if ready:
            idx = torch.tensor(ready, device=dev)
            self._sample_and_append([reqs[i] for i in ready], out.logits_BTV[idx, -1], outputs)

    def _decode(self, outputs: dict[str, StepOutput]) -> None:
        reqs = [r for r in self.running.values() if r.pending == 1 and r.num_computed > 0 and not r.finish_reason]
        if not reqs:
            return
        n = max(r.slot for r in reqs) + 1
        out = self.graphs.run(reqs, n) if self.graphs is not None else None
        token_B, logprob_B, routing_BLK = out if out is not None else self._decode_eager(reqs, n)
        token_B, logprob_B, routing_BLK = token_B.cpu(), logprob_B.cpu(), routing_BLK.to(torch.int16).cpu()
        # One vectorised write of every row's routing into its slot's row of the host-side routing table.
        slots = torch.tensor([r.slot for r in reqs])
        self.routing[slots, torch.tensor([r.num_computed for r in reqs])] = routing_BLK[slots]
        tokens, logprobs = token_B.tolist(), logprob_B.tolist()  # two host lists, not 2 x 256 tensor indexings
        for req in reqs:
            req.num_routed = req.num_computed + 1
            req.num_computed += 1
            self._append(req, tokens[req.slot], logprobs[req.slot], outputs)
        self.stats["decode_tokens"] += len(reqs)
        self.stats["decode_steps"] += 1

    def decode_inputs(self, reqs: list[_Request], n: int, ids_B: torch.Tensor, pos_B: torch.Tensor,
                      write_B: torch.Tensor, sampling: SamplingBatch) -> None:
        """Fill a padded decode batch of n rows (row = slot); rows without a request write to scratch."""
        ids_B.zero_()
        pos_B.zero_()
        write_B.fill_(self.cache.scratch_column)
        rows = torch.tensor([r.slot for r in reqs], device=ids_B.device)
        ids_B[rows] = torch.tensor([r.tokens[-1] for r in reqs]).to(ids_B.device)
        pos_B[rows] = torch.tensor([r.num_computed for r in reqs]).to(pos_B.device)
        write_B[rows] = pos_B[rows]
        sampling.set_rows([r.slot for r in reqs], [r.params for r in reqs], [r.seed for r in reqs],
                          [len(r.tokens) for r in reqs])

    def decode_forward(self, ids_B: torch.Tensor, pos_B: torch.Tensor, write_B: torch.Tensor,
                       sampling: SamplingBatch, kv_len: int, hints: dict | None = None):
        """The decode computation: a forward over a padded batch, then sampling (what the graphs capture)."""
        n = ids_B.shape[0]
        key_S = torch.arange(kv_len, device=ids_B.device)
        mask = (key_S[None, :] <= pos_B[:, None])[:, None, None, :]
        plan = ForwardPlan(torch.arange(n, device=ids_B.device), write_B[:, None], slice(0, n), kv_len, mask)
        out = self.model.forward_full(ids_B[:, None], position_ids_BT=pos_B[:, None],
                                      kv_caches=self.cache.views(plan), attn_mask=mask)
        token_B, logprob_B = sample(out.logits_BTV[:, -1], sampling, **(hints or {}))
        return token_B, logprob_B, out.routed_experts_BTLK[:, 0]

    def _decode_eager(self, reqs: list[_Request], n: int):
        dev = self.device
        ids_B, pos_B, write_B = (torch.zeros(n, dtype=torch.long, device=dev) for _ in range(3))
        sampling = SamplingBatch.empty(n, dev)
        self.decode_inputs(reqs, n, ids_B, pos_B, write_B, sampling)
        kv_len = max(r.num_computed for r in reqs) + 1
        return self.decode_forward(ids_B, pos_B, write_B, sampling, kv_len, sampling_hints(reqs))

    def _sample_and_append(self, reqs: list[_Request], logits_BV: torch.Tensor, outputs) -> None:
        sampling = SamplingBatch.empty(len(reqs), self.device)
        sampling.set_rows(list(range(len(reqs))), [r.params for r in reqs], [r.seed for r in reqs],
                          [len(r.tokens) for r in reqs])
        token_B, logprob_B = sample(logits_BV, sampling, **sampling_hints(reqs))
        for r, tok, lp in zip(reqs, token_B.tolist(), logprob_B.tolist()):
            self._append(r, tok, lp, outputs)

    def _append(self, req: _Request, token: int, logprob: float, outputs: dict[str, StepOutput]) -> None:
        req.tokens.append(token)
        req.generated.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version)
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
        if self.running.get(req.slot) is req:
            del self.running[req.slot]
        if req.slot >= 0:
            routing = self.routing[req.slot, : req.num_routed].clone()
        elif req.prefix_routing is not None:
            routing = req.prefix_routing
        else:
            routing = self.routing.new_zeros(0, *self.routing.shape[2:])
        completion = Completion(req.id, req.tokens[: req.num_prompt], list(req.generated), list(req.logprobs),
                                list(req.versions), routing, req.finish_reason, seed=req.seed)
        if self.config.deterministic and completion.token_ids and req.finish_reason != "abort":
            self._rescore(completion, req)
        return completion

    @torch.no_grad()
    def _rescore(self, completion: Completion, req: _Request) -> None:
        """Deterministic mode: log-probs and routing from one full forward over the positions the engine ran,
        the function the trainer computes, so they agree bitwise (see docs/rollout.md)."""
        inputs = torch.tensor([req.tokens[:-1]], device=self.device)
        out = self.model.forward_full(inputs)
        temp = req.params.temperature or 1.0
        logp_TV = torch.log_softmax(out.logits_BTV[0, req.num_prompt - 1:].float() / temp, dim=-1)
        targets = torch.tensor(req.generated, device=self.device)
        completion.logprobs = logp_TV.gather(1, targets[:, None]).squeeze(1).tolist()
        completion.routed_experts = out.routed_experts_BTLK[0].to(torch.int16).cpu()


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
