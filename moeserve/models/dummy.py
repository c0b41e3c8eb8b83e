"""``--load-format dummy`` (vLLM's name): seeded random weights made on the device, no checkpoint files.

:class:`DummyReader` is a drop-in for :class:`~moeserve.models.checkpoint.CheckpointReader`
wherever weights are read (``load_model`` and the families' loaders, ``ExpertStore.from_checkpoint``,
migrations' digests in tests): the same methods, the same names, shapes and canonical expert
layout, but every tensor is made directly on the reader's device from ``config.json`` alone
(and ``generation_config.json`` when present). Only ``config.json`` must exist in the folder.

Values are uniform in [-1e-3, 1e-3] (vLLM's ``initialize_dummy_weights``); RMSNorm weights are
ones, so activations keep a sensible scale through the layers. Each tensor comes from its own
generator, seeded by ``(seed, tensor name)`` (and, for a fused expert tensor, the expert's
row), so:

- every rank that asks for a tensor or an expert gets identical bytes, whatever else it read
  before and in whichever order; replicas of an expert on different workers are bit-identical,
  and a migrated expert equals the one the destination would have read itself;
- values are made in float32 and cast to the requested dtype, so a tensor read in two dtypes
  is the same numbers rounded twice.

The bytes depend on the device *type* (torch's CPU and CUDA generators differ) and, on CUDA, on
the GPU model (the kernel's grid follows the SM count); ranks of one cluster on one kind of
GPU agree. ``bytes_read`` / ``tensors_read`` count what was made, as the checkpoint reader
counts what it read.

Names are those a checkpoint of the config would hold, in the layout the families publish
(``moeserve.models.families``): Llama 4 and GPT-OSS with fused experts (``experts.gate_up_proj
[E, H, 2I]``, ``experts.down_proj [E, I, H]``), the others with per-expert tensors; ERNIE's
gate and ``mlp.moe_statics.e_score_correction_bias [1, E]`` in fp32.

**Hot experts (skewed routing, off by default).** ``hot=(k, share)`` (the reader's argument), else
the environment's ``MOESERVE_DUMMY_HOT_EXPERTS=k:share``, else config.json's
``"moeserve_dummy_hot_experts": {"experts": k, "share": share}`` makes k experts of every MoE
layer (chosen per layer from ``(seed, layer)``, the same on every rank; config.json's ``"ids"``
names them instead, the same in every layer) take about ``share`` of
the routed (token, k) pairs, so that a load balancer has something to fix. Without it every
tensor is as above, byte for byte. With it:

- every family whose routing has no correction bias (Llama 4, Qwen3-MoE, Mixtral, GPT-OSS: the
  top-k of the gate's logits or of a softmax of them, the same experts): the embedding is made 1,000 times larger (uniform in
  [-1, 1]) so that it dominates the residual stream (every sublayer adds about 1e-3), and its
  hidden channel 0 is the constant 1: every MoE input then carries about the same positive value
  there. The hot experts' router rows get a weight ``b`` on channel 0, the others 0. Given a
  token, the other channels' logits are about Gaussian, independent over experts, with standard
  deviation ``sqrt(H - 1) * sigma_e * sigma_w`` relative to channel 0 (sigma: a uniform draw's);
  ``b`` is that times the margin ``d`` under which k of E standard normals shifted by d take
  ``share`` of the top-k picks (:func:`hot_margin`, a seeded Monte Carlo bisection).
- ERNIE (top-k on softmax + correction bias): the embedding is made 1,000 times larger too (so
  that the routers see each token's own embedding, not a state every token shares), and the
  correction bias is 0 but ``d * sqrt(H) * sigma_w / E`` on the hot experts (the softmax of small
  logits is about ``(1 + l) / E``).

The share is about what the argument asks (within a few points on random prompts; decode steps
route the generated tokens, whatever they are); at most ``k / top_k`` (every token picks every hot
expert) and at least the uniform ``k / E``.

**Spread routing (off by default).** ``routing="spread"`` (the reader's argument), else the
environment's ``MOESERVE_DUMMY_ROUTING=spread``, else config.json's ``"moeserve_dummy_routing":
"spread"`` (``"default"`` anywhere is the plain weights; anything else is refused by name) spreads
the routed pairs about evenly over the experts of every MoE layer, as a trained model's
load-balancing loss does. The plain weights do not: every sublayer adds about 1e-3 to a residual
stream whose embedding is about 1e-3 too, so at real widths every token's MoE input looks alike,
and a correction bias as large as the gate's score differences (ERNIE's, DeepSeek-V3's) picks the
same experts for most of them; greedy decoding then samples the same few ids for every sequence.
With it, in every family (hot experts exclude it):

- the embedding is made 1,000 times larger (uniform in [-1, 1]), so that every router sees the
  token's own embedding: a random direction per token id, whose logits are about independent over
  experts under the random gate;
- the gate's biases and the correction bias are 0, so that no expert is favoured (a trained
  model's correction bias is what balances its load);
- decode stays spread because greedy decoding maps distinct ids to distinct ids: the last hidden
  state is about the current token's embedding, so a tied LM head (ERNIE's) scores that token
  highest and each sequence repeats its last id, and an untied one is made of the embedding's
  rows shifted by one (``lm_head[v] = embed[v - 1]``) so that each sequence walks ``t, t + 1,
  t + 2, ...`` (mod V). Sequences whose prompts end in distinct ids (random prompts) never
  generate the same id in a step, so every decode step routes as many distinct tokens as it has
  sequences.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from moeserve.models import families
from moeserve.models import quant as Q
from moeserve.models.checkpoint import (
    CheckpointReader,
    expert_spec,
    read_expert,
    read_experts,
)
from moeserve.models.config import CheckpointError, ModelConfig, load_config, with_quantization
from moeserve.models.moe import ExpertSpec

LOAD_FORMATS = ("auto", "dummy")
LOW, HIGH = -1e-3, 1e-3  # vLLM's dummy init range
HOT_ENV = "MOESERVE_DUMMY_HOT_EXPERTS"  # "k:share", e.g. "2:0.8"
HOT_CONFIG_KEY = "moeserve_dummy_hot_experts"  # config.json: {"experts": k, "share": share}
EMBED_SCALE = 1e3  # hot experts and spread routing: the embedding dominates the residual stream
HOT_CHANNEL = 0  # hot experts: the embedding carries the constant 1 on this channel
ROUTING_ENV = "MOESERVE_DUMMY_ROUTING"  # "default" or "spread"
ROUTING_CONFIG_KEY = "moeserve_dummy_routing"  # config.json: "default" or "spread"
ROUTINGS = ("default", "spread")
SIGMA_UNIFORM = (HIGH - LOW) / math.sqrt(12.0)  # standard deviation of a dummy value


def open_reader(
    path: str | Path,
    load_format: str = "auto",
    device: torch.device | str = "cpu",
    seed: int = 0,
    quantization: str | None = None,
) -> CheckpointReader | DummyReader:
    """The reader for ``load_format``: "auto" reads the checkpoint files (on the CPU; callers
    move tensors), "dummy" makes seeded random weights on ``device``. ``quantization`` ("fp8",
    vLLM's ``--quantization``) serves a bf16 checkpoint with FP8 weights."""
    if load_format == "auto":
        return CheckpointReader(path, quantization=quantization)
    if load_format == "dummy":
        return DummyReader(path, seed=seed, device=device, quantization=quantization)
    raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")


def parse_hot(spec, source: str = "hot experts") -> tuple[int, float] | None:
    """``"k:share"``, ``{"experts": k, "share": share}``, ``(k, share)`` or nothing -> (k, share)
    or None (also for k = 0). Raises ValueError naming ``source`` (where the value came from)
    and the form expected."""
    if spec is None or spec == "" or spec == {}:
        return None
    try:
        if isinstance(spec, str):
            k_text, _, share_text = spec.partition(":")
            k, share = int(k_text), float(share_text or 0.8)
        elif isinstance(spec, dict):
            k, share = int(spec["experts"]), float(spec.get("share", 0.8))
        else:
            k, share = int(spec[0]), float(spec[1])
    except (ValueError, KeyError, TypeError, IndexError):
        raise ValueError(
            f'{source} must be \'k:share\' (e.g. 2:0.8) or {{"experts": k, "share": s}}, got {spec!r}'
        ) from None
    if k < 0 or not 0.0 < share < 1.0:
        raise ValueError(f"{source}: k must be >= 0 and share in (0, 1), got k={k}, share={share}")
    return (k, share) if k else None


def parse_routing(value, source: str = "dummy routing") -> str:
    """``"default"``, ``"spread"`` or nothing (the default) -> one of ``ROUTINGS``. Raises
    ValueError naming ``source`` (where the value came from) and the values allowed."""
    if value is None or value == "":
        return "default"
    if not isinstance(value, str) or value not in ROUTINGS:
        raise ValueError(f"{source}: {value!r} is not a dummy routing; allowed: {', '.join(ROUTINGS)}")
    return value


def hot_margin(num_experts: int, top_k: int, hot: int, share: float, samples: int = 20000) -> float:
    """The shift d >= 0 of ``hot`` of ``num_experts`` standard normal scores under which the hot
    ones take ``share`` of the top-``top_k`` picks (seeded Monte Carlo, bisection on common draws:
    the same number in every process). Capped at 12 (every token picks every hot expert)."""
    if hot >= num_experts:
        return 0.0
    z = np.random.default_rng(12345).standard_normal((samples, num_experts))
    kth = num_experts - top_k

    def got(d: float) -> float:
        s = z.copy()
        s[:, :hot] += d
        top = np.argpartition(s, kth, axis=1)[:, kth:]
        return float((top < hot).mean())

    lo, hi = 0.0, 12.0
    if got(lo) >= share:
        return 0.0
    if got(hi) <= share:
        return hi
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if got(mid) < share else (lo, mid)
    return (lo + hi) / 2


def tensor_seed(seed: int, key: str) -> int:
    """A 63-bit generator seed from (seed, key), the same in every process (not Python's hash)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{key}".encode()).digest()[:8], "little") >> 1


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every text-model tensor a checkpoint of ``cfg`` holds, and its shape (published layouts,
    ``families.checkpoint_shapes``), with each FP8 weight's scale beside it."""
    out = families.checkpoint_shapes(cfg)
    scheme = cfg.quantization
    if scheme is not None:  # each FP8 weight's scale beside it, as the checkpoint format stores it
        for module in fp8_modules(cfg, out):
            rows, cols = out[f"{module}.weight"]
            bo, bi = scheme.block_of(rows, cols)
            out[f"{module}.{scheme.scale_name}"] = (-(-rows // bo), -(-cols // bi))
    return out


def linear_modules(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The linear layers (as compressed-tensors targets them) among a checkpoint's tensors."""
    return [
        n[: -len(".weight")]
        for n, s in shapes.items()
        if n.endswith(".weight") and len(s) == 2 and not n.startswith("model.embed")
    ]


def fp8_modules(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The linear layers a dummy checkpoint of ``cfg`` stores in FP8 (``cfg.quantization``'s)."""
    scheme = cfg.quantization
    if scheme is None:
        return []
    if scheme.format == "online":
        return [m for m in linear_modules(shapes) if scheme.online_quantizes(m)]
    # The routers and the LM head are read in the model dtype (never FP8 codes): a config that
    # does not list them as unconverted (DeepSeek-V3's names no module) keeps them so.
    n = families.names(cfg)
    kept = {"lm_head"} | {f"{n.layer(i)}.{n.router}" for i in cfg.moe_layer_ids}
    return [m for m in linear_modules(shapes) if not scheme.ignores(m) and m not in kept]


def declared_scheme(cfg: ModelConfig) -> ModelConfig:
    """A dummy checkpoint is made directly in FP8: ``--quantization fp8`` on it reads as the
    compressed-tensors checkpoint it would quantize to (per channel, dynamic per-token
    activations, as ``--quantization fp8`` on real weights; the MLPs and experts; the other linear
    layers named in its ignore list), never as bf16 weights quantized later."""
    scheme = cfg.quantization
    if scheme is None or scheme.format != "online":
        return cfg
    every = replace(cfg, quantization=Q.QuantScheme("compressed-tensors", "channel"))  # the FP8 layout's names
    keep = tuple(m for m in linear_modules(checkpoint_shapes(every)) if not scheme.online_quantizes(m))
    declared = Q.QuantScheme("compressed-tensors", "channel", activations="token", ignore=keep)
    return replace(cfg, quantization=declared)


class DummyReader:
    """A checkpoint folder's ``config.json``, read as if its weights were seeded random numbers.

    ``device``: where every tensor is made (the caller's ``.to(device)`` is then a no-op);
    ``seed``: with the tensor's name, the seed of its generator.
    """

    prefix = ""

    def __init__(
        self,
        path: str | Path,
        seed: int = 0,
        device: torch.device | str = "cpu",
        hot=None,
        quantization: str | None = None,
        routing: str | None = None,
    ):
        self.path = Path(path)
        self.config: ModelConfig = declared_scheme(with_quantization(load_config(self.path), quantization))
        self.seed = int(seed)
        self.device = torch.device(device)
        self.bytes_read = 0
        self.tensors_read = 0
        self._shapes = checkpoint_shapes(self.config)
        self._fp8 = set(fp8_modules(self.config, self._shapes))
        try:
            with open(self.path / "config.json") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}
        source = "hot experts"
        if hot is None and os.environ.get(HOT_ENV):
            hot, source = os.environ[HOT_ENV], HOT_ENV
        if hot is None and raw.get(HOT_CONFIG_KEY) is not None:
            hot, source = raw[HOT_CONFIG_KEY], f"{self.path / 'config.json'}: {HOT_CONFIG_KEY}"
        self.hot = parse_hot(hot, source)
        if routing is not None:
            self.routing = parse_routing(routing, "routing")
        elif os.environ.get(ROUTING_ENV):
            self.routing = parse_routing(os.environ[ROUTING_ENV], ROUTING_ENV)
        else:
            self.routing = parse_routing(
                raw.get(ROUTING_CONFIG_KEY), f"{self.path / 'config.json'}: {ROUTING_CONFIG_KEY}"
            )
        if self.routing == "spread" and self.hot:
            raise ValueError(
                f"dummy weights: spread routing and hot experts {self.hot[0]}:{self.hot[1]} exclude each other "
                f"(spread balances every expert's load, hot experts skew it): leave out {ROUTING_ENV} / "
                f"{ROUTING_CONFIG_KEY} or {HOT_ENV} / {HOT_CONFIG_KEY}"
            )
        cfg = self.config
        ids = hot.get("ids") if isinstance(hot, dict) and self.hot else None
        self._fixed_hot = None
        if ids is not None:
            assert self.hot is not None  # ids come only with a hot spec
            ids = sorted(int(e) for e in ids)
            if len(ids) != self.hot[0] or len(set(ids)) != len(ids) or not all(0 <= e < cfg.num_experts for e in ids):
                raise ValueError(
                    f"hot experts: ids must be {self.hot[0]} distinct experts of 0..{cfg.num_experts - 1}, got {ids}"
                )
            self._fixed_hot = ids
        if self.hot and self.hot[0] > cfg.num_experts:
            raise ValueError(f"hot experts: k={self.hot[0]} > {cfg.num_experts} experts")
        self._hot_value = 0.0
        if self.hot:
            d = hot_margin(cfg.num_experts, cfg.top_k, self.hot[0], self.hot[1])
            sigma_w = SIGMA_UNIFORM
            if not cfg.routing.correction_bias:
                sigma_e = SIGMA_UNIFORM * EMBED_SCALE
                self._hot_value = d * math.sqrt(cfg.hidden_size - 1) * sigma_e * sigma_w
            else:
                # the scores' spread: a softmax's ~ sigma_l / E, a sigmoid's ~ sigma_l / 4 (its slope at 0)
                spread = 0.25 if cfg.routing.scoring == "sigmoid" else 1 / cfg.num_experts
                self._hot_value = d * math.sqrt(cfg.hidden_size) * sigma_w * spread

    def hot_experts(self, moe_layer: int) -> list[int]:
        """The hot experts of MoE layer ``moe_layer`` (the ordinal), [] without hot experts."""
        if not self.hot:
            return []
        if self._fixed_hot is not None:
            return list(self._fixed_hot)
        rng = np.random.default_rng(tensor_seed(self.seed, f"hot-experts:{moe_layer}"))
        return sorted(int(e) for e in rng.permutation(self.config.num_experts)[: self.hot[0]])

    def close(self) -> None:
        """Hand the float32 temporaries back to the device, so that what is free afterwards (the
        KV cache is sized from it) is not held in torch's cache."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> DummyReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- tensors -------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._shapes)

    def has(self, name: str) -> bool:
        return name in self._shapes

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[self._known(name)]

    def stored_dtype(self, name: str) -> torch.dtype:
        self._known(name)
        module, _, leaf = name.rpartition(".")
        if module in self._fp8:
            return Q.FP8 if leaf == "weight" else torch.float32  # the codes, and their scale
        return torch.float32 if self._fp32(name) else self.config.dtype

    def _fp32(self, name: str) -> bool:
        """A correction bias, and the gate of a family that keeps it in fp32 (ERNIE), are fp32."""
        cfg = self.config
        n = families.names(cfg)
        gate = cfg.routing.gate_fp32 and name.endswith(f".{n.ffn}.{n.router}.weight")
        return gate or name.endswith("e_score_correction_bias")

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        found = self.shape(name)
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{self._source}: tensor '{name}' has shape {list(found)}, expected {list(expected)}")

    def read(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """One whole tensor (a fused expert tensor: its experts' rows stacked), made on the device."""
        if shape is not None:
            self.check_shape(name, shape)
        full = self.shape(name)
        if self._fused(name):
            return self.read_rows(name, 0, full[0], dtype)
        module, _, leaf = name.rpartition(".")
        if module in self._fp8:
            return self._make_fp8(name, full, dtype) if leaf == "weight" else self._make_scale(name, full, dtype)
        made = self._skewed(name, full) if self.hot else self._spread(name, full) if self.routing == "spread" else None
        if made is not None:
            dtype = dtype or self.stored_dtype(name)
            return made if made.dtype == dtype else made.to(dtype)
        return self._make(name, full, dtype or self.stored_dtype(name), ones=_is_norm(name))

    def _spread(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """With spread routing: the tensors that differ from the plain dummy ones (float32), else None."""
        cfg = self.config
        embed = "model.embed_tokens.weight"
        if name == embed:
            return self._make(name, shape, torch.float32).mul_(EMBED_SCALE)
        if name == "lm_head.weight":  # untied: lm_head[v] = embed[v - 1], so greedy maps t to t + 1
            return torch.roll(self._make(embed, shape, torch.float32).mul_(EMBED_SCALE), 1, dims=0)
        n = families.names(cfg)
        biases = [f".{n.ffn}.{n.router}.bias", *(f".{n.ffn}.{c}" for c in n.correction_bias)]
        if not name.endswith(tuple(biases)) or int(name.split(".")[2]) not in cfg.moe_layer_ids:
            return None
        t = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t

    def _skewed(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """With hot experts: the tensors that differ from the plain dummy ones (float32), else None."""
        cfg = self.config
        by_bias = cfg.routing.correction_bias  # top-k on scores + bias: the bias makes them hot
        if name == "model.embed_tokens.weight":
            t = self._make(name, shape, torch.float32) * EMBED_SCALE
            if not by_bias:
                t[:, HOT_CHANNEL] = 1.0
            return t
        n = families.names(cfg)
        router = f".{n.ffn}.{n.correction_bias[0] if by_bias else n.router + '.weight'}"
        if not name.endswith(router):
            return None
        decoder_layer = int(name.split(".")[2])
        hot = self.hot_experts(cfg.moe_layer_ids.index(decoder_layer))
        if not by_bias:
            t = self._make(name, shape, torch.float32)
            t[:, HOT_CHANNEL] = 0.0
            t[hot, HOT_CHANNEL] = self._hot_value
        else:
            t = torch.zeros(shape, dtype=torch.float32, device=self.device)
            t.view(-1)[hot] = self._hot_value  # [1, E] or [E] (DeepSeek-V3)
            self.bytes_read += t.numel() * t.element_size()
            self.tensors_read += 1
        return t

    def read_rows(self, name: str, start: int, count: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``start .. start+count-1`` of dim 0: [count, *shape[1:]]. A fused expert tensor's
        rows are made one expert at a time (each its own generator), so reading one expert and
        reading the whole tensor agree."""
        full = self.shape(name)
        if not full or not 0 <= start <= start + count <= full[0]:
            raise CheckpointError(
                f"{self._source}: tensor '{name}' of shape {full} has no rows {start}..{start + count - 1}"
            )
        dtype = dtype or self.stored_dtype(name)
        if self._fused(name):
            rows = [self._make(f"{name}[{r}]", full[1:], dtype) for r in range(start, start + count)]
            if not rows:
                return torch.empty((0, *full[1:]), dtype=dtype, device=self.device)
            return torch.stack(rows) if count > 1 else rows[0].unsqueeze(0)
        return self.read(name, dtype)[start : start + count].clone()

    # -- routed experts (as CheckpointReader: canonical gate_up [H, 2I], down [I, H]) --------------

    def _experts_prefix(self, moe_layer: int) -> str:
        cfg = self.config
        if not 0 <= moe_layer < cfg.num_moe_layers:
            raise ValueError(
                f"MoE layer index {moe_layer} out of range 0..{cfg.num_moe_layers - 1} "
                f"(the ordinal among MoE layers, not the decoder-layer index)"
            )
        return families.names(cfg).experts(cfg.moe_layer_ids[moe_layer])

    def expert_layout(self, moe_layer: int) -> str:
        return "fused" if self.has(self._experts_prefix(moe_layer) + "gate_up_proj") else "per_expert"

    def expert_spec(self, dtype: torch.dtype | None = None) -> ExpertSpec:
        return expert_spec(self.config, dtype or self.config.dtype)

    def read_expert(self, moe_layer: int, expert: int, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return read_expert(self, moe_layer, expert, dtype)

    def read_experts(self, moe_layer: int, ids, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return read_experts(self, moe_layer, ids, dtype)

    # -- making ----------------------------------------------------------------------------------

    @property
    def _source(self) -> str:
        return f"{self.path} (load_format dummy)"

    def _known(self, name: str) -> str:
        if name not in self._shapes:
            raise CheckpointError(
                f"{self._source}: tensor '{name}' is missing (a checkpoint of this config.json has no such tensor)"
            )
        return name

    def _fused(self, name: str) -> bool:
        return families.names(self.config).fused and name.endswith(
            (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_up_proj_bias", ".experts.down_proj_bias")
        )

    def _make_fp8(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """FP8 codes made as such on the device (no float copy first): seeded random bytes that
        are never one of e4m3fn's two NaN codes (0x7f, 0xff)."""
        if dtype not in (None, Q.FP8):
            raise CheckpointError(
                f"{self._source}: tensor '{name}' is FP8: it is read with its scale, never as {dtype}"
            )
        gen = torch.Generator(device=self.device)
        gen.manual_seed(tensor_seed(self.seed, name))
        raw = torch.randint(0, 254, shape, dtype=torch.uint8, device=self.device, generator=gen)
        raw += (raw >= 0x7F).to(torch.uint8)  # 0..126, 128..254
        self.bytes_read += raw.numel()
        self.tensors_read += 1
        return raw.view(Q.FP8)

    def _make_scale(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> torch.Tensor:
        """Scales that put the codes in vLLM's dummy range: |w| <= 448 * scale = 1e-3."""
        t = torch.full(shape, HIGH / Q.FP8_MAX, dtype=torch.float32, device=self.device)
        self.bytes_read += t.numel() * 4
        self.tensors_read += 1
        return t if dtype in (None, torch.float32) else t.to(dtype)

    def _make(self, key: str, shape: tuple[int, ...], dtype: torch.dtype, ones: bool = False) -> torch.Tensor:
        if ones:
            t = torch.ones(shape, dtype=dtype, device=self.device)
        else:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(tensor_seed(self.seed, key))
            t = torch.empty(shape, dtype=torch.float32, device=self.device).uniform_(LOW, HIGH, generator=gen)
            if dtype != torch.float32:
                t = t.to(dtype)
        self.bytes_read += t.numel() * t.element_size()
        self.tensors_read += 1
        return t


def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "layernorm.weight"))
