"""The family-neutral decoder: load a checkpoint, run a step, forward, generate.

Dimension letters: B rows of a batch, T tokens (a step's tokens, flattened over sequences),
H hidden size, V vocabulary, K experts per token, E logical experts, I expert width.

Every decoder layer is ``h = x + Attn(norm(x)); y = h + FFN(norm(h))`` and the stack ends with
a final norm and the LM head. The FFN is a dense SwiGLU or a MoE layer, which the step runs
through the seam of moe.py, in exactly this order (the data plane plugs its distributed
backend in here)::

    u = post_attention_norm(h); r = block.route(u)
    handle = experts.dispatch(moe_layer_index, u, r)   # rows leave for the experts
    s = block.shared(u)                                # overlaps with the exchange
    y = experts.combine(handle) + s                    # (or the routed part alone)

The backend sees the MoE layer index (0 .. num_moe_layers-1), never the decoder-layer index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from moeserve import kernels
from moeserve.models import families
from moeserve.models.cache import KVCache, StepBatch
from moeserve.models.checkpoint import expert_spec
from moeserve.models.config import ModelConfig
from moeserve.models.layers import (
    Attention,
    Linear,
    SwiGLU,
    add_rms_norm,
    load_linear,
    load_swiglu,
    rope_cos_sin,
    rope_inv_freq,
    silu_mul,
)
from moeserve.models.mla import LatentKVCache, MLAttention, load_mla
from moeserve.models.moe import ExpertsBackend, ExpertSpec, LocalExperts
from moeserve.models.paged import PagedBatch, PagedKVCache
from moeserve.models.routing import MoEBlock
from moeserve.ops.profiling import span
from moeserve.sampling import Sampler, SamplingParams


@dataclass(frozen=True)
class MoEInfo:
    """What expert-parallel load balancing needs to know about a model (vLLM's MixtureOfExperts).

    moe_layer_ids[m] is the decoder-layer index of MoE layer m; every per-layer table of the
    data and control planes is indexed by m. expert_bytes = expert_spec.nbytes, the cost of
    moving one expert's weights.
    """

    num_moe_layers: int
    moe_layer_ids: tuple[int, ...]
    num_logical_experts: int
    num_shared_experts: int
    top_k: int
    num_expert_groups: int
    expert_spec: ExpertSpec
    expert_bytes: int

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype: torch.dtype) -> MoEInfo:
        spec = expert_spec(cfg, dtype)
        return cls(
            num_moe_layers=cfg.num_moe_layers,
            moe_layer_ids=cfg.moe_layer_ids,
            num_logical_experts=cfg.num_experts,
            num_shared_experts=cfg.num_shared_experts,
            top_k=cfg.top_k,
            num_expert_groups=cfg.routing.n_group,
            expert_spec=spec,
            expert_bytes=spec.nbytes,
        )


@dataclass
class DecoderLayer:
    """One decoder layer's router-side weights; ``mlp`` for dense layers, ``moe_index`` for MoE layers."""

    input_norm: torch.Tensor  # [H]
    attn: Attention | MLAttention
    post_norm: torch.Tensor  # [H]
    mlp: SwiGLU | None
    moe_index: int | None


class DecoderModel:
    """A decoder of any family (inference only), split at the router/expert seam.

    ``moe_blocks[m]`` is the router side of MoE layer m (``route``, ``shared``); ``experts`` holds
    every routed expert (a :class:`LocalExperts`), or is None when loaded with
    ``load_experts=False``, in which case ``step`` needs an ``experts`` backend.
    """

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[DecoderLayer],
        norm: torch.Tensor,
        lm_head: Linear,
        moe_blocks: list[MoEBlock],
        experts: LocalExperts | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # weight [V, H] (the embedding when tied)
        self.moe_blocks = moe_blocks
        self.experts = experts
        self.dtype, self.device = dtype, device
        self.moe_info = MoEInfo.from_config(config, dtype)
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope).to(device)  # [D/2] fp32
        self.rope_scale = config.rope.attention_factor if config.rope.type == "yarn" else 1.0
        self.norm_first = config.norm_weight_fp32  # norm weights in fp32, applied before the cast

    def new_cache(self) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.cache_heads, c.cache_dim, self.dtype, self.device)

    def new_paged_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens for this model's
        layers, dtype and device (pools [num_layers, num_blocks * block_size, Hkv, D]; with MLA
        the latent pool of ``LatentKVCache``)."""
        c = self.config
        if c.mla is not None:
            return LatentKVCache(c.num_layers, c.cache_dim, num_blocks, block_size, self.dtype, self.device)
        return PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size, self.dtype, self.device)

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(
        self,
        input_ids: torch.Tensor,
        batch: StepBatch | PagedBatch,
        cache: KVCache | PagedKVCache,
        experts: ExpertsBackend | None = None,
        check_ids: bool = True,
    ) -> torch.Tensor:
        """Run the new tokens of several sequences through the model, appending to ``cache``.

        input_ids: LongTensor [T], the sequences' new tokens back to back, in ``batch`` order.
        Returns the hidden states after the final norm: [T, H]. An empty batch (T = 0) still
        calls the backend once per MoE layer.

        ``(StepBatch, KVCache)``: the eager cache, which tracks each sequence's length itself.
        ``(PagedBatch, PagedKVCache)``: the caller owns the block tables (it allocated the
        blocks the batch's slots and tables name) and the batch's tensors are on the model's
        device; each layer writes its k/v at ``batch.slot_mapping`` and attends in one call.

        ``check_ids=False``: the caller checked the ids on the host (the range check reads the
        device tensor back, which a CUDA graph cannot capture and a step should not pay for).
        """
        experts = experts if experts is not None else self.experts
        if experts is None and self.config.num_moe_layers:
            raise ValueError("this model was loaded with load_experts=False: pass an experts backend to step()")
        input_ids = self._check_ids(input_ids.reshape(-1)) if check_ids else input_ids.reshape(-1)
        if input_ids.numel() != batch.num_tokens:
            raise ValueError(f"input_ids has {input_ids.numel()} tokens but the batch's lens sum to {batch.num_tokens}")
        if isinstance(cache, PagedKVCache):
            self._check_paged(batch, cache)
        elif isinstance(batch, PagedBatch):
            raise TypeError("a PagedBatch needs a PagedKVCache (model.new_paged_cache)")
        else:
            cache.begin(batch)
        positions = batch.positions.to(self.device)  # [T]
        rope = rope_cos_sin(positions, self.inv_freq, self.rope_scale)  # 2 x [T, D/2]
        eps, first = self.config.rms_norm_eps, self.norm_first
        with span("embed"):
            h = self.embed[input_ids.to(self.device)]  # [T, H]
        delta: torch.Tensor | None = None  # the last block's output, added to h with the next norm
        for layer in self.layers:
            with span("attention"):
                h, x = add_rms_norm(h, delta, layer.input_norm, eps, first)  # [T, H] each
                delta = layer.attn(x, batch, positions, rope, cache)
            h, u = add_rms_norm(h, delta, layer.post_norm, eps, first)  # [T, H]
            if layer.moe_index is None:
                assert layer.mlp is not None  # a dense layer has its MLP
                with span("dense_mlp"):
                    delta = layer.mlp(u)
                continue
            assert experts is not None  # checked above: a model with MoE layers has a backend
            block = self.moe_blocks[layer.moe_index]
            with span("gate"):
                routing = block.route(u)  # ids, weights [T, K]
            with span("moe_dispatch"):
                handle = experts.dispatch(layer.moe_index, u, routing)
            with span("shared_expert"):
                shared = block.shared(u)  # [T, H] or None
            with span("moe_combine"):
                routed = experts.combine(handle)  # [T, H]
            delta = routed if shared is None else routed + shared
        if not isinstance(cache, PagedKVCache) and not isinstance(batch, PagedBatch):  # (the eager cache)
            cache.commit(batch)
        return add_rms_norm(h, delta, self.norm, eps, first)[1]

    def warm_up_norms(self) -> int:
        """Compile, before serving, the fused norm, RoPE and MLP activation kernels
        (``moeserve.kernels.rms_norm``, ``head_rope``, ``silu_mul``) for every row shape and kind
        a step of this model launches: the residual stream's norms with and without the
        residual, each attention's q/k transforms, the dense MLPs' and shared experts' silu *
        up. Returns the calls run; 0 where the torch path serves (CPU)."""
        h = torch.zeros(1, self.config.hidden_size, dtype=self.dtype, device=self.device)
        if not self.layers or not kernels.fused_norms_take(h, self.norm, self.norm_first):
            return 0
        eps, first = self.config.rms_norm_eps, self.norm_first
        rope = rope_cos_sin(torch.zeros(1, dtype=torch.long, device=self.device), self.inv_freq, self.rope_scale)
        n = 0
        for layer in self.layers:
            for norm in (layer.input_norm, layer.post_norm):
                add_rms_norm(h, None, norm, eps, first)
                add_rms_norm(h, h, norm, eps, first)
                n += 2
            n += layer.attn.warm_up_norms(rope, self.dtype, self.device)
        add_rms_norm(h, h, self.norm, eps, first)
        mlps = [layer.mlp for layer in self.layers] + [block.shared_mlp for block in self.moe_blocks]
        # the merged MLPs' activation widths: silu_mul (SwiGLU.__call__), or silu_mul_quant before a W8A8 down
        widths: set[int] = set()
        quantized: set[int] = set()
        for m in mlps:
            if m is None or (w := m.merged_width) is None:
                continue
            gu = torch.zeros(1, w, dtype=self.dtype, device=self.device)
            (quantized if m.quantizes_activation(gu) else widths).add(w)
        for w in sorted(widths):  # one key per width
            silu_mul(torch.zeros(1, w, dtype=self.dtype, device=self.device))
        for w in sorted(quantized):
            kernels.silu_mul_quant(torch.zeros(1, w, dtype=self.dtype, device=self.device))
        return n + 1 + len(widths) + len(quantized)

    def _check_paged(self, batch: StepBatch | PagedBatch, cache: PagedKVCache) -> None:
        """Host-side checks of a paged step (no device synchronisation)."""
        if not isinstance(batch, PagedBatch):
            raise TypeError(f"a PagedKVCache needs a PagedBatch, found {type(batch).__name__}")
        c = self.config
        if (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype, _dev(cache.device)) != (
            c.num_layers,
            c.cache_heads,
            c.cache_dim,
            self.dtype,
            _dev(self.device),
        ):
            raise ValueError(
                f"the PagedKVCache (layers {cache.num_layers}, kv heads {cache.num_kv_heads}, head dim "
                f"{cache.head_dim}, {cache.dtype} on {cache.device}) does not fit this model (layers "
                f"{c.num_layers}, kv heads {c.cache_heads}, head dim {c.cache_dim}, {self.dtype} on "
                f"{self.device})"
            )
        if batch.block_size != cache.block_size:
            raise ValueError(
                f"the PagedBatch was built for block_size {batch.block_size} but the cache's is {cache.block_size}"
            )
        if _dev(batch.positions.device) != _dev(cache.device):
            raise ValueError(
                f"the PagedBatch is on {batch.positions.device} but the cache on {cache.device}: "
                f"build it with device=model.device"
            )

    def linears(self):
        """Every linear layer of the router-side model (attention projections, dense MLPs,
        shared experts): ``Linear`` or ``QuantLinear``."""
        for layer in self.layers:
            a = layer.attn
            yield from a.linears()
            if layer.mlp is not None:
                yield from layer.mlp.linears()
        for block in self.moe_blocks:
            mlp = block.shared_mlp
            if mlp is not None:
                yield from mlp.linears()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: hidden [N, H] -> logits [N, V] in the model dtype."""
        return self.lm_head(hidden)

    def logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``logits(hidden)`` written into ``out`` [N, V] (a static buffer of the decode graphs)."""
        return self.lm_head.into(hidden, out)

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be an integer tensor, found {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.config.vocab_size)][0]
            raise ValueError(f"token id {int(bad)} out of range 0..{self.config.vocab_size - 1}")
        return ids.long()

    # -- whole sequences -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids LongTensor [B, T] -> logits [B, T, V], each row from position 0, no cache kept."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, found shape {list(input_ids.shape)}")
        b, t = input_ids.shape
        hidden = self.step(input_ids.reshape(-1), StepBatch.prefill(range(b), [t] * b), self.new_cache())
        return self.logits(hidden).view(b, t, -1)

    __call__ = forward

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        ignore_eos: bool = False,
        eos_token_ids: tuple[int, ...] | list[int] | None = None,
    ) -> torch.Tensor:
        """Continue each row of input_ids [B, T]: returns LongTensor [B, T + n], prompt included.

        As transformers' generate: greedy at temperature 0; a row stops after an EOS token
        (``eos_token_ids``, default the model's) and is padded with the pad id (or the first EOS
        id when the model has none); n = max_new_tokens, or fewer when every row stopped
        early. Each row is its own request with the same sampling parameters and seed.
        """
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, T] with T >= 1, found shape {list(input_ids.shape)}")
        params = SamplingParams(temperature, top_p, top_k, seed)
        eos = tuple(self.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        prompts = [row.tolist() for row in input_ids]
        new = self.generate_ids(prompts, [params] * len(prompts), max_new_tokens, ignore_eos, eos)
        width = max(len(n) for n in new)
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else (eos[0] if eos else 0)
        out = torch.full((len(prompts), input_ids.shape[1] + width), pad, dtype=torch.long)
        out[:, : input_ids.shape[1]] = input_ids
        for b, n in enumerate(new):
            out[b, input_ids.shape[1] : input_ids.shape[1] + len(n)] = torch.tensor(n, dtype=torch.long)
        return out

    @torch.inference_mode()
    def generate_ids(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        max_new_tokens: int,
        ignore_eos: bool = False,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> list[list[int]]:
        """Continue prompts of any lengths (one request each): returns the new token ids of each.

        All prompts are prefilled in one step, then each live sequence gets one token per step.
        A sequence ends after max_new_tokens tokens or, unless ignore_eos, after an EOS token
        (which is included).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, found {max_new_tokens!r}")
        if len(params) != len(prompts):
            raise ValueError(f"need one SamplingParams per prompt, found {len(params)} for {len(prompts)} prompts")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        eos = set(self.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        samplers = [Sampler(p) for p in params]
        new: list[list[int]] = [[] for _ in prompts]
        cache = self.new_cache()
        live = list(range(len(prompts)))
        batch = StepBatch.prefill(live, [len(p) for p in prompts])
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        while live and max_new_tokens:
            hidden = self.step(ids, batch, cache)  # [T, H]
            logits = self.logits(hidden[batch.last_token_index.to(self.device)])  # [S, V]
            still = []
            for row, s in enumerate(live):
                tok = samplers[s].sample(logits[row])
                new[s].append(tok)
                if len(new[s]) < max_new_tokens and (ignore_eos or tok not in eos):
                    still.append(s)
                else:
                    cache.release(s)
            live = still
            batch = StepBatch(tuple(live), (1,) * len(live), tuple(cache.length(s) for s in live))
            ids = torch.tensor([new[s][-1] for s in live], dtype=torch.long)
        return new


def _dev(d: torch.device) -> tuple[str, int]:
    """A device as (type, index), "cuda" meaning the current CUDA device (tensors always carry an index)."""
    if d.index is None and d.type == "cuda":
        return d.type, torch.cuda.current_device()
    return d.type, d.index or 0


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_experts: bool = True,
    load_format: str = "auto",
    reader=None,
    quantization: str | None = None,
) -> DecoderModel:
    """Load a checkpoint folder of any family (``moeserve.models.families``).

    ``load_experts=False`` builds the router-side model only: no routed-expert weight is read
    and ``model.experts`` is None (an expert backend is then passed to ``step``).
    ``load_format="dummy"`` makes seeded random weights on ``device`` from config.json alone
    (``moeserve.models.dummy``); ``reader`` (a CheckpointReader or DummyReader) overrides both.
    ``quantization="fp8"`` (vLLM's ``--quantization``) quantizes a bf16 checkpoint's experts and
    MLPs at load; an FP8 checkpoint is served as its config.json's quantization_config says.
    """
    device = torch.device(device)
    if reader is None:
        from moeserve.models.dummy import open_reader

        reader = open_reader(path, load_format, device, quantization=quantization)
    with reader:
        cfg = reader.config
        names = families.names(cfg)
        h, v = cfg.hidden_size, cfg.vocab_size
        norm_dtype = torch.float32 if cfg.norm_weight_fp32 else dtype
        embed = reader.read("model.embed_tokens.weight", dtype, shape=(v, h)).to(device)
        layers, blocks = [], []
        for i in range(cfg.num_layers):
            attn = (
                load_mla(reader, cfg, i, dtype, device) if cfg.mla else _load_attention(reader, cfg, i, dtype, device)
            )
            norms = [
                reader.read(f"model.layers.{i}.{n}.weight", norm_dtype, shape=(h,)).to(device)
                for n in ("input_layernorm", "post_attention_layernorm")
            ]
            m = cfg.moe_index(i)
            mlp = None
            if m is None:
                mlp = load_swiglu(reader, names.layer(i), h, cfg.intermediate_size, cfg.mlp_bias, dtype, device)
            else:
                blocks.append(MoEBlock.load(reader, cfg, i, dtype, device))
            layers.append(DecoderLayer(norms[0], attn, norms[1], mlp, m))
        norm = reader.read("model.norm.weight", norm_dtype, shape=(h,)).to(device)
        head_w = embed if cfg.tie_word_embeddings else reader.read("lm_head.weight", dtype, shape=(v, h)).to(device)
        head_b = reader.read("lm_head.bias", dtype, shape=(v,)).to(device) if cfg.mlp_bias else None
        experts = None
        if load_experts and cfg.num_moe_layers:
            spec = MoEInfo.from_config(cfg, dtype).expert_spec
            weights = [
                {
                    k: t.to(device)
                    for k, t in spec.canonical_stack(reader.read_experts(m, range(cfg.num_experts), dtype)).items()
                }
                for m in range(cfg.num_moe_layers)
            ]
            experts = LocalExperts(spec, weights)
    return DecoderModel(cfg, embed, layers, norm, Linear(head_w, head_b), blocks, experts, dtype, device)


def _load_attention(reader, cfg: ModelConfig, i: int, dtype: torch.dtype, device) -> Attention:
    """Decoder layer ``i``'s attention: q, k, v, o (biases with ``attention_bias``), Qwen3's
    q_norm / k_norm [D], GPT-OSS's sinks [Hq] (held in fp32)."""
    p, h, d = f"model.layers.{i}.self_attn", cfg.hidden_size, cfg.head_dim
    q_out, kv_out, ab = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.attention_bias
    q_norm = k_norm = sinks = None
    if cfg.qk_rms_norm:
        q_norm = reader.read(f"{p}.q_norm.weight", dtype, shape=(d,)).to(device)
        k_norm = reader.read(f"{p}.k_norm.weight", dtype, shape=(d,)).to(device)
    if cfg.attention_sinks:
        sinks = reader.read(f"{p}.sinks", torch.float32, shape=(cfg.num_heads,)).to(device)
    return Attention(
        cfg,
        i,
        q=load_linear(reader, f"{p}.q_proj", q_out, h, ab, dtype, device),
        k=load_linear(reader, f"{p}.k_proj", kv_out, h, ab, dtype, device),
        v=load_linear(reader, f"{p}.v_proj", kv_out, h, ab, dtype, device),
        o=load_linear(reader, f"{p}.o_proj", h, q_out, ab, dtype, device),
        q_norm=q_norm,
        k_norm=k_norm,
        sinks=sinks,
    )
