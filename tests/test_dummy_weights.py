"""``load_format="dummy"``: seeded random weights from config.json alone, the same bytes for a
tensor or an expert in every reader and on every rank, so a cluster (redundant replicas, a live
migration) generates what the single-process model with the same dummy weights generates."""

import shutil
import threading
import time

import numpy as np
import pytest
import torch
from cluster_util import assert_workers_hold, moe_info, prompts_for, random_placement, reference_generate

from moeserve.cluster import LocalCluster
from moeserve.config import ClusterConfig
from moeserve.models import CheckpointError, DummyReader, families, init_model, load_model
from moeserve.models.checkpoint import CheckpointReader
from moeserve.models.families import FAMILIES

WORKERS = 2
REDUNDANT = 4
MAX_TOKENS = 24


def config_only(tmp_path, family: str, **overrides):
    """A folder holding config.json and generation_config.json of a tiny model, and nothing else."""
    full = init_model(tmp_path / "full", family, seed=5, **overrides)
    folder = tmp_path / "dummy"
    folder.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(full / name, folder / name)
    return folder


def dummy_digests(path) -> np.ndarray:
    """float64 [L, E, 2]: (sum, sum of squares) of every logical expert as a worker would hold it."""
    info = moe_info(path)
    spec = info.expert_spec
    out = np.zeros((info.num_moe_layers, info.num_logical_experts, 2))
    with DummyReader(path) as r:
        for layer in range(info.num_moe_layers):
            for e in range(info.num_logical_experts):
                flat = spec.flat(r.read_expert(layer, e, dtype=spec.dtype)).double()
                out[layer, e] = [flat.sum().item(), (flat * flat).sum().item()]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_two_readers_make_identical_tensors_whatever_they_read_before(tmp_path, family):
    path = config_only(tmp_path, family)
    a, b = DummyReader(path), DummyReader(path)
    names = a.names()
    assert names == sorted(CheckpointReader(init_model(tmp_path / "ref", family, seed=5)).names())
    for name in reversed(names):  # b reads in the other order
        b.read(name)
    for name in names:
        ta, tb = a.read(name), b.read(name)
        assert ta.shape == a.shape(name) and ta.dtype == a.stored_dtype(name)
        assert torch.equal(ta, tb), name
        if not name.endswith("norm.weight"):
            assert 0 < ta.abs().max() <= 1e-3 and len(ta.unique()) > 1, name
        else:
            assert torch.equal(ta, torch.ones_like(ta))
    assert 2 * a.bytes_read == b.bytes_read > 0 and 2 * a.tensors_read == b.tensors_read  # b read everything twice
    # An expert read alone equals its share of the whole (fused or per-expert) tensors, in any
    # order, and a bf16 read is the float32 numbers rounded.
    layer, e = a.config.num_moe_layers - 1, a.config.num_experts - 1
    alone = DummyReader(path).read_expert(layer, e)
    stacked = a.read_experts(layer, [e, 0, e])
    for k in ("gate_up", "down"):
        assert torch.equal(alone[k], stacked[k][0]) and torch.equal(alone[k], stacked[k][2])
    assert torch.equal(a.read_expert(layer, e, dtype=torch.bfloat16)["down"], alone["down"].to(torch.bfloat16))
    assert not torch.equal(a.read_expert(layer, 0)["down"], alone["down"])
    # Another seed gives other numbers; an unknown name or a wrong shape is refused as a checkpoint would.
    assert not torch.equal(DummyReader(path, seed=1).read(names[0]), a.read(names[0]))
    with pytest.raises(CheckpointError, match="missing"):
        a.read("model.layers.99.nothing.weight")
    with pytest.raises(CheckpointError, match="shape"):
        a.read("model.embed_tokens.weight", shape=(1, 2))


def test_load_model_dummy_needs_only_config_json_and_the_load_format_is_checked(tmp_path):
    path = config_only(tmp_path, "llama4")
    with pytest.raises(CheckpointError):
        load_model(path)  # auto: the safetensors files are missing
    m1 = load_model(path, load_format="dummy")
    m2 = load_model(path, reader=DummyReader(path))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(m1(ids), m2(ids))
    with pytest.raises(ValueError, match="load_format"):
        load_model(path, load_format="nope")
    with pytest.raises(ValueError, match="load_format"):
        ClusterConfig(model_dir=str(path), load_format="nope")
    assert (
        ClusterConfig.from_json(ClusterConfig(model_dir=str(path), load_format="dummy").to_json()).load_format
        == "dummy"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES)
def test_cluster_with_dummy_weights_generates_the_single_process_tokens_through_a_migration(tmp_path, family):
    path = config_only(tmp_path, family)
    info = moe_info(path)
    model = load_model(path, load_format="dummy")
    prompts = prompts_for(model.config.vocab_size, lengths=(4, 7, 2, 9))
    tokens = [reference_generate(model, p, MAX_TOKENS) for p in prompts]
    digests = dummy_digests(path)
    slots = info.num_logical_experts + REDUNDANT
    start = random_placement(info.num_moe_layers, info.num_logical_experts, slots, seed=1)
    target = random_placement(info.num_moe_layers, info.num_logical_experts, slots, seed=2)
    with LocalCluster(
        path,
        routers=1,
        workers=WORKERS,
        num_redundant_experts=REDUNDANT,
        placement=start,
        load_format="dummy",
        migration_bytes_per_step=info.expert_bytes,
    ) as c:
        assert c.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True) == tokens
        assert_workers_hold(c, start, digests)  # replicas on both workers are bit-identical
        result = {}
        t = threading.Thread(
            target=lambda: result.update(out=c.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True))
        )
        t.start()
        time.sleep(0.2)
        c.apply_placement(target, wait=True)  # one expert per worker per step: spans many steps
        t.join(120)
        assert result["out"] == tokens
        np.testing.assert_array_equal(c.placement().phy2log, target)
        assert_workers_hold(c, target, digests)  # a moved expert equals the one read in place
        assert c.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True) == tokens


def routed_ids(model, prompts: int = 8, length: int = 64, seed: int = 3) -> list[torch.Tensor]:
    """The expert ids [T, K] every MoE layer routes a prefill of random prompts to."""
    from moeserve.models.cache import StepBatch

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, cfg.vocab_size, (prompts * length,), generator=gen)
    seen: dict[int, torch.Tensor] = {}

    class Spy:
        def dispatch(self, layer, hidden, routing):
            seen[layer] = routing.ids
            return model.experts.dispatch(layer, hidden, routing)

        def combine(self, handle):
            return model.experts.combine(handle)

    model.step(ids, StepBatch.prefill(range(prompts), [length] * prompts), model.new_cache(), experts=Spy())
    return [seen[m] for m in sorted(seen)]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hot_experts_take_about_their_share_and_the_default_is_unchanged(tmp_path, family, monkeypatch):
    from moeserve.models.dummy import HOT_CONFIG_KEY, HOT_ENV, hot_margin, parse_hot

    monkeypatch.delenv(HOT_ENV, raising=False)
    path = config_only(tmp_path, family)
    plain = DummyReader(path)
    assert plain.hot is None and plain.hot_experts(0) == []
    k = 2
    cfg = plain.config
    share = min(0.8, 0.9 * k / cfg.top_k)  # top-4: at most k / top_k (every token picks every hot expert)
    hot = DummyReader(path, hot=(k, share))
    # Only the embedding and the routers' hot parameters differ from the plain weights.
    differ = [n for n in plain.names() if not torch.equal(plain.read(n), hot.read(n))]
    router = families.names(cfg).router
    allowed = (
        ("e_score_correction_bias", "embed_tokens.weight")
        if cfg.routing.correction_bias
        else (f"{router}.weight", "embed_tokens.weight")
    )
    assert differ and all(n.endswith(allowed) for n in differ), differ
    assert all(
        torch.equal(DummyReader(path, hot=(k, share)).read(n), hot.read(n)) for n in differ
    )  # same on every rank
    layers = hot.config.num_moe_layers
    hot_ids = [hot.hot_experts(m) for m in range(layers)]
    assert all(len(h) == k for h in hot_ids)
    # Routing: the hot experts take about `share` of the pairs in every MoE layer; without, about k / E.
    base = [float(np.isin(r.numpy(), h).mean()) for r, h in zip(routed_ids(load_model(path, reader=plain)), hot_ids)]
    got = [float(np.isin(r.numpy(), h).mean()) for r, h in zip(routed_ids(load_model(path, reader=hot)), hot_ids)]
    print(family, "hot share asked", share, "got", got, "plain", base)
    assert all(abs(g - share) < 0.1 for g in got), (got, share)
    assert np.mean(base) < share - 0.15, base
    # The forms of the option, and where it comes from: the argument, the environment, config.json.
    assert parse_hot("2:0.8") == (2, 0.8) == parse_hot({"experts": 2, "share": 0.8}) and parse_hot("0:0.5") is None
    with pytest.raises(ValueError, match="k:share"):
        parse_hot("two")
    with pytest.raises(ValueError, match="share"):
        parse_hot("2:1.5")
    monkeypatch.setenv(HOT_ENV, f"{k}:{share}")
    assert DummyReader(path).hot == (k, share)
    monkeypatch.setenv(HOT_ENV, "many")  # refused by the variable's name
    with pytest.raises(ValueError, match=f"{HOT_ENV} must be 'k:share'"):
        DummyReader(path)
    monkeypatch.delenv(HOT_ENV)
    import json

    conf = json.loads((path / "config.json").read_text())
    conf[HOT_CONFIG_KEY] = {"experts": k, "share": share}
    (path / "config.json").write_text(json.dumps(conf))
    assert DummyReader(path).hot == (k, share)
    conf[HOT_CONFIG_KEY]["ids"] = [3, 1]
    (path / "config.json").write_text(json.dumps(conf))
    assert all(DummyReader(path).hot_experts(m) == [1, 3] for m in range(layers))
    conf[HOT_CONFIG_KEY]["ids"] = [1]
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="distinct"):
        DummyReader(path)
    assert 0 < hot_margin(16, 1, 2, 0.8) < hot_margin(16, 1, 2, 0.9) and hot_margin(16, 1, 2, 0.05) == 0.0


def _balancedness(ids: torch.Tensor, experts: int) -> float:
    counts = np.bincount(ids.flatten().numpy(), minlength=experts)
    return float(counts.mean() / counts.max())


@pytest.mark.parametrize("family", FAMILIES)
def test_spread_routing_loads_every_expert_and_keeps_decode_spread(tmp_path, family, monkeypatch):
    from moeserve.models.dummy import HOT_ENV, ROUTING_CONFIG_KEY, ROUTING_ENV, parse_routing

    monkeypatch.delenv(HOT_ENV, raising=False)
    monkeypatch.delenv(ROUTING_ENV, raising=False)
    path = config_only(tmp_path, family)
    plain, spread = DummyReader(path), DummyReader(path, routing="spread")
    assert plain.routing == "default" and spread.routing == "spread"
    cfg = plain.config
    n = families.names(cfg)
    # Only the embedding, an untied LM head, the routers' biases and the correction biases differ.
    differ = [name for name in plain.names() if not torch.equal(plain.read(name), spread.read(name))]
    allowed = ("embed_tokens.weight", "lm_head.weight", f"{n.router}.bias", *n.correction_bias)
    assert "model.embed_tokens.weight" in differ and all(name.endswith(allowed) for name in differ), differ
    assert all(torch.equal(DummyReader(path, routing="spread").read(name), spread.read(name)) for name in differ)
    experts = cfg.num_experts
    base = [_balancedness(r, experts) for r in routed_ids(load_model(path, reader=plain), prompts=16, length=32)]
    model = load_model(path, reader=spread)
    got = [_balancedness(r, experts) for r in routed_ids(model, prompts=16, length=32)]
    print(family, "balancedness plain", base, "spread", got)
    assert min(got) >= 0.55, got  # 512 tokens: a uniform router's max load is within about 1.5x its mean
    if cfg.routing.correction_bias:  # ERNIE, DeepSeek-V3: the plain weights pick the same few experts
        assert max(base) < 0.45, base
    # Decode stays spread: every sequence gets its own id each step (distinct last prompt ids).
    prompts = torch.randint(3, cfg.vocab_size, (8, 5), generator=torch.Generator().manual_seed(1))
    assert len(set(prompts[:, -1].tolist())) == 8
    new = model.generate(prompts, 6, ignore_eos=True)[:, 5:]
    last = prompts[:, -1:]
    if cfg.tie_word_embeddings:
        assert torch.equal(new, last.expand_as(new))  # a tied head repeats the last id
    else:
        assert torch.equal(new, (last + torch.arange(1, 7)) % cfg.vocab_size)  # an untied one walks t + 1, ...
    # Where it comes from (the argument, the environment, config.json) and what is refused.
    assert parse_routing(None) == parse_routing("") == "default"
    with pytest.raises(ValueError, match="allowed: default, spread"):
        DummyReader(path, routing="even")
    monkeypatch.setenv(ROUTING_ENV, "spread")
    assert DummyReader(path).routing == "spread"
    with pytest.raises(ValueError, match="exclude each other"):
        DummyReader(path, hot=(2, 0.5))
    monkeypatch.setenv(ROUTING_ENV, "sideways")
    with pytest.raises(ValueError, match=f"{ROUTING_ENV}: 'sideways' is not a dummy routing"):
        DummyReader(path)
    monkeypatch.delenv(ROUTING_ENV)
    import json

    conf = json.loads((path / "config.json").read_text())
    conf[ROUTING_CONFIG_KEY] = "spread"
    (path / "config.json").write_text(json.dumps(conf))
    assert DummyReader(path).routing == "spread"
    conf[ROUTING_CONFIG_KEY] = 3
    (path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=f"{ROUTING_CONFIG_KEY}: 3 is not a dummy routing"):
        DummyReader(path)
