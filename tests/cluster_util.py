"""Helpers shared by the multi-process cluster tests (tiny checkpoints, placements, oracles)."""

from __future__ import annotations

import numpy as np
import torch

from moeserve.models import CheckpointReader, MoEInfo, StepBatch, init_model, load_config, load_model


def tiny_checkpoint(path, family: str, **overrides):
    """A small random checkpoint written by moeserve's own init_model (no transformers)."""
    return init_model(path, family=family, seed=11, **overrides)


def moe_info(model_dir) -> MoEInfo:
    return MoEInfo.from_config(load_config(model_dir), torch.float32)


def random_placement(layers: int, experts: int, slots: int, seed: int) -> np.ndarray:
    """phy2log [L, P]: every expert once, the redundant slots random, all shuffled per layer."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(layers):
        row = np.concatenate([np.arange(experts), rng.integers(0, experts, slots - experts)])
        rows.append(rng.permutation(row))
    return np.stack(rows)


def redundant_for(experts: int, workers: int, at_least: int = 1) -> int:
    """The smallest R >= at_least with (E + R) % W == 0."""
    r = at_least
    while (experts + r) % workers:
        r += 1
    return r


def expert_digests(model_dir) -> np.ndarray:
    """float64 [L, E, 2]: (sum, sum of squares) of every logical expert's weights, as a worker
    holding it would report them."""
    info = moe_info(model_dir)
    reader = CheckpointReader(model_dir)
    spec = info.expert_spec
    out = np.zeros((info.num_moe_layers, info.num_logical_experts, 2))
    for layer in range(info.num_moe_layers):
        for e in range(info.num_logical_experts):
            flat = spec.flat(reader.read_expert(layer, e, dtype=spec.dtype)).double()
            out[layer, e] = [flat.sum().item(), (flat * flat).sum().item()]
    return out


def assert_workers_hold(cluster, phy2log: np.ndarray, digests: np.ndarray) -> None:
    """Every slot of every worker holds exactly the weights of the expert phy2log names."""
    held = np.concatenate(cluster.slot_digests(), axis=1)  # [L, P, 2]
    want = np.take_along_axis(digests, np.asarray(phy2log)[:, :, None].repeat(2, axis=2), axis=1)
    np.testing.assert_allclose(held, want, rtol=1e-9, atol=1e-9)


def reference_model(model_dir):
    return load_model(model_dir, dtype=torch.float32)


def prompts_for(vocab: int, lengths=(5, 9, 3), seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


@torch.inference_mode()
def reference_generate(model, prompt, n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, temperature=0.0, ignore_eos=True)
    return out[0, len(prompt) :].tolist()


@torch.inference_mode()
def reference_decode(model, prompt, n: int) -> tuple[list[int], np.ndarray]:
    """Greedy decoding on the single-process model with its KV cache, one sequence: the
    generated ids and the float32 logits [n, V] each was taken from. This is the computation
    a cluster performs (prefill, then one token per step), so it is the reference for the
    cluster's per-token logits; a full forward over prompt + output differs from it at the
    fp32 noise level (up to ~1e-4 on the tiny ERNIE model)."""
    cache = model.new_cache()
    ids, start, toks, logits = list(prompt), 0, [], []
    for _ in range(n):
        batch = StepBatch(seq_ids=(0,), lens=(len(ids),), starts=(start,))
        row = model.logits(model.step(torch.tensor(ids), batch, cache)[-1:])[0].float()
        logits.append(row.numpy())
        toks.append(int(row.argmax()))
        start += len(ids)
        ids = [toks[-1]]
    return toks, np.stack(logits)


@torch.inference_mode()
def reference_logits(model, ids) -> np.ndarray:
    """float32 [T, V]: the single-process logits at every position of ids."""
    return model(torch.tensor([ids]))[0].float().numpy()
