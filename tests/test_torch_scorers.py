"""kvpop_torch's scorers and settings equal kvpop_jax's: same parameters, same scores and states."""

import dataclasses
import os
import re
import subprocess
import sys
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util

from helpers import REPO
from kvpop_jax import KVpopConfig
from kvpop_jax import config as jax_config
from kvpop_jax.kvpop import KVpopHead as JaxHead
from kvpop_jax import scorers as jax_scorers
from kvpop_jax.scorers import mlstm_step
import kvpop_torch
from kvpop_torch import config as torch_config
from kvpop_torch.config import KVpopSettings
from kvpop_torch import scorers as torch_scorers
from kvpop_torch.scorers import KVpopHead

HKV, D = 2, 16
SCORERS = [
    dict(scorer="linear"),
    dict(scorer="mlp", scorer_hidden=8),
    dict(scorer="mlstm"),
    dict(scorer="mlstm", delayed_readout=False),
    dict(scorer="mlstm", mlstm_feature_map="softmax", mlstm_value="cached", mlstm_norm=True),
    dict(scorer="mlstm", mlstm_skip=True, mlstm_gate_softcap=0.0, mlstm_dim=8, mlstm_chunk=5),
]


def test_transformers_older_than_4_56_is_refused_by_version():
    """transformers < 4.56 build a Cache's layers from classes (no Cache(layers=[...])), so KVpopCache cannot be
    one: the package names the version and the fix on import. 4.56 to 5.23 are served since the mask rides on the
    keys (on 4.57 every decode had failed with "Can't instantiate abstract class KVpopLayer", on 5.0-5.23 with
    "attn_implementation='kvpop' needs a KVpopCache" given one), and are no longer refused."""
    for old in ("4.55.4", "4.53.0", "3.5.1", "4.55.99.dev0", "nightly"):
        with pytest.raises(ImportError, match=f"kvpop_torch needs transformers >= 4.56 .*found {old}: pip install"):
            kvpop_torch.check_transformers_version(old)
    for new in ("4.56.0", "4.57.6", "5.0.0", "5.23.0", "5.23.1.dev0", "5.24.0", "5.25.0.dev0", "5.100.1", "6.0"):
        kvpop_torch.check_transformers_version(new)
    kvpop_torch.check_transformers_version(transformers.__version__)  # the one these tests run on
    old = subprocess.run([sys.executable, "-c", "import transformers; transformers.__version__ = '4.55.4'; "
                          "import kvpop_torch"], capture_output=True, text=True)
    assert old.returncode != 0 and old.stderr.strip().splitlines()[-1].startswith(
        "ImportError: kvpop_torch needs transformers >= 4.56"), old.stderr[-400:]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:  # the torch extra installs what the import accepts
        extra = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    assert [r for r in extra if r.startswith("transformers")] == ["transformers>=4.56"]


def test_ci_tests_kvpop_torch_at_the_floors_the_torch_extra_declares():
    """.ci/run's run 4 installs exactly the `torch` extra's floors (transformers, torch): a floor raised or lowered in
    one place and not the other would be declared without being tested."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["torch"]
    found = [re.fullmatch(r"([a-z]+)>=([0-9.]+)", r) for r in extra]
    assert all(found), f"the torch extra declares floors, not pins (a user's own torch stays): {extra}"
    floors = dict(m.groups() for m in found)
    with open(os.path.join(REPO, ".ci", "run")) as f:
        ci = f.read()
    tested = dict(transformers=re.search(r"TORCH_FLOOR=\$\{TORCH_FLOOR:-([0-9.]+)\}", ci).group(1),
                  torch=re.search(r"TORCH_VERSION=\$\{TORCH_VERSION:-([0-9.]+)\}", ci).group(1))
    assert {name: tested[name].removesuffix(".0") for name in tested} == floors, (floors, tested)
    assert tuple(int(x) for x in floors["transformers"].split(".")) == kvpop_torch.MIN_TRANSFORMERS


def test_settings_read_every_serving_field_with_kvpop_jax_defaults():
    jax_fields = {f.name: f.default for f in dataclasses.fields(KVpopConfig)}
    torch_fields = {f.name: f.default for f in dataclasses.fields(KVpopSettings)}
    # What serving never reads is the config's own list; test_generate checks none of it changes a decode.
    assert set(jax_fields) == set(torch_fields) | set(KVpopConfig.TRAINING_ONLY)
    assert {n: jax_fields[n] for n in torch_fields} == torch_fields
    # a config.json without head_dim: both read it as transformers builds the model (it was hidden // heads here)
    assert torch_config.DEFAULT_HF_HEAD_DIM == jax_config.DEFAULT_HF_HEAD_DIM == transformers.Qwen3Config().head_dim
    kv = KVpopConfig(sinks=1, window=2, topk=3, scorer="mlstm", mlstm_dim=8, mlstm_skip=True, gamma_min=0.9)
    settings = KVpopSettings.from_dict(kv.to_dict())
    assert all(getattr(settings, n) == getattr(kv, n) for n in torch_fields)
    assert settings.budget == kv.budget and settings.mlstm_value_dim(D) == kv.mlstm_value_dim(D)
    with pytest.raises(ValueError, match="scorer must be one of"):
        KVpopSettings(scorer="lstm")
    for field in ("delayed_readout", "mlstm_skip", "mlstm_norm"):  # "false" is truthy: refused, as kvpop_jax does
        with pytest.raises(ValueError, match=f"kvpop.{field} must be true or false, got 'false'"):
            KVpopSettings.from_dict({**kv.to_dict(), field: "false"})
    # Hand edits that crashed later with bare TypeErrors or ZeroDivisionError (gamma "0.999" or null, chunk 0):
    for field, value, message in (("gamma_min", "0.999", "gamma_min must be a finite number, got '0.999'"),
                                  ("gamma_max", None, "gamma_max must be a finite number, got None"),
                                  ("mlstm_gate_softcap", "15", "mlstm_gate_softcap must be a finite number"),
                                  ("mlstm_gate_softcap", -1.0, "mlstm_gate_softcap must be >= 0"),
                                  ("mlstm_chunk", 0, "mlstm_chunk must be an int >= 1, got 0"),
                                  ("mlstm_chunk", 1.5, "mlstm_chunk must be an int >= 1, got 1.5"),
                                  ("scorer_hidden", -1, "scorer_hidden must be an int >= 1, got -1"),
                                  ("mlstm_dim", 0, "mlstm_dim must be null or an int >= 1, got 0")):
        with pytest.raises(ValueError, match=f"kvpop.{message}"):
            KVpopSettings.from_dict({**kv.to_dict(), field: value})
    assert torch_config.TRAINING_ONLY == KVpopConfig.TRAINING_ONLY
    with pytest.raises(ValueError, match=r"fields this kvpop_torch does not know: \['mlstm_dims', 'new_knob'\]"):
        KVpopSettings.from_dict({**kv.to_dict(), "mlstm_dims": 8, "new_knob": 1})  # was silently ignored


def heads(options, rng):
    """A JAX KVpopHead's parameters (random) and the torch head loaded with the same tensors."""
    kv = KVpopConfig(sinks=2, window=5, topk=4, **{"mlstm_chunk": 8, **options})
    module = JaxHead(kv, HKV, D)
    dummy = jnp.zeros((1, 1, HKV, D))
    shapes = jax.eval_shape(module.init, jax.random.key(0), dummy, dummy)["params"]
    params = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), shapes)
    head = KVpopHead(KVpopSettings.from_dict(kv.to_dict()), HKV, D)
    flat = traverse_util.flatten_dict(params, sep=".")  # the export's names, prefix stripped
    head.load_state_dict({k: torch.tensor(np.asarray(v)) for k, v in flat.items()})
    return kv, module, params, head


def jax_reference(head, k, v, k_t, v_t):
    """Scores and log γ of k, v [B, S, H, D]; for the mLSTM also the state after S tokens (a token
    scan, as `KVpopHead.prefill_cache`), that state after one more token k_t, v_t [B, H, D], and
    its readout of token 3."""
    scores, log_gamma = head(k, v)
    if head.config.scorer != "mlstm":
        return scores, log_gamma
    _, kk, vv, i_pre, log_f = head.scorer.features(k, v)
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (kk, vv, i_pre, log_f))
    state, _ = jax.lax.scan(lambda st, x: (mlstm_step(st, *x), None), head.scorer.init_state(k.shape[0]), xs)
    stepped = head.scorer.step(state, k_t, v_t)
    return scores, log_gamma, state, stepped, head.scorer.readout(stepped, k[:, 3], v[:, 3])


@pytest.mark.parametrize("options", SCORERS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_scores_states_and_steps_match_kvpop_jax(rng, options):
    kv, module, params, head = heads(options, rng)
    k, v = (rng.normal(size=(2, 23, HKV, D)).astype(np.float32) for _ in range(2))
    k_t, v_t = (rng.normal(size=(2, HKV, D)).astype(np.float32) for _ in range(2))
    want = jax.jit(lambda p, *x: module.apply({"params": p}, *x, method=jax_reference))(params, k, v, k_t, v_t)
    def close(a, b):  # float32 sums of terms up to the output's largest size: atol scales with it
        b = np.asarray(b)
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(b).max())))

    close(head.scorer(torch.from_numpy(k), torch.from_numpy(v)), want[0])
    close(head.log_gamma(), want[1])
    if kv.scorer != "mlstm":
        return
    # The prefill's final state (chunkwise here, a token scan there), one decode step and a readout.
    _, state = head.scorer.scores_and_state(torch.from_numpy(k), torch.from_numpy(v))
    for a, b in zip(state, want[2]):
        close(a, b)
    state = head.scorer.step(state, torch.from_numpy(k_t), torch.from_numpy(v_t))
    for a, b in zip(state, want[3]):
        close(a, b)
    close(head.scorer.readout(state, torch.from_numpy(k[:, 3]), torch.from_numpy(v[:, 3])), want[4])


@pytest.mark.parametrize("gap", [120.0, 72.0])
def test_mlstm_readout_is_finite_at_extreme_gates(rng, gap):
    """Gates far outside the soft-cap (i ~ +150: exp(-m) underflows to 0; i ~ -300: it overflows)
    and Hedgehog features whose query is orthogonal to the key it reads (q^T n = 0 for gap 120):
    the torch prefill and decode give kvpop_jax's finite readout, not 0/0 = NaN."""
    b, h, s, delay, dv = 2, 2, 24, 2, 5
    sign = rng.choice([-1.0, 1.0], size=(b, h, s, 1))
    c = sign * (gap / 2 + 0.5 * np.abs(rng.normal(size=(b, h, s, 1))))
    z = np.concatenate([c, -c], axis=-1).astype(np.float32)
    k = np.array(jax_scorers.hedgehog(jnp.asarray(z)))
    q = np.array(jax_scorers.hedgehog(jnp.asarray(-z[:, :, np.minimum(np.arange(s) + delay, s - 1)])))
    v = rng.normal(size=(b, h, s, dv)).astype(np.float32)
    i = (np.array([150.0, -300.0])[None, :, None] + rng.normal(scale=5.0, size=(b, h, s))).astype(np.float32)
    log_f = np.array(jax.nn.log_sigmoid(jnp.asarray(rng.normal(loc=-200.0, size=(b, h, s)), jnp.float32)))
    want = np.asarray(jax_scorers.mlstm_quadratic(q, k, v, i, log_f, delay=delay))
    assert np.isfinite(want).all()
    got, _ = torch_scorers.mlstm_chunkwise(*(torch.tensor(x) for x in (q, k, v, i, log_f)), delay=delay, chunk=8)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    state = torch_scorers.mlstm_init_state(b, h, 4, dv, torch.device("cpu"))
    for t in range(s):
        state = torch_scorers.mlstm_step(state, *(torch.from_numpy(x[:, :, t]) for x in (k, v, i, log_f)))
        if t >= delay:
            got = torch_scorers.mlstm_readout(state, torch.from_numpy(q[:, :, t - delay])).numpy()
            np.testing.assert_allclose(got, want[:, :, t - delay], rtol=1e-5, atol=1e-5)
