"""HF safetensors import/export: round trips and every error with its message."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import traverse_util

from kvpop_jax import KVpopConfig, Qwen3Config, load_pretrained, save_pretrained
from kvpop_jax.checkpoint import check_checkpoint
from kvpop_jax.config import DMSConfig, hf_layer_types
from kvpop_jax.modeling import Qwen3ForCausalLM


def _flat(params):
    return traverse_util.flatten_dict(jax.device_get(params), sep="/")


@pytest.mark.parametrize("name", ["g1_tied", "g4_bias"])
def test_export_loads_in_transformers_with_same_logits(hf_checkpoint, tmp_path, rng, name):
    path, torch_model = hf_checkpoint(name)
    config, params = load_pretrained(path)
    out = tmp_path / "exported"
    save_pretrained(config, params, out)
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()
    ids = rng.integers(0, config.vocab_size, size=(2, 13))
    with torch.no_grad():
        a = torch_model(torch.tensor(ids)).logits.numpy()
        b = reloaded(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    ours = Qwen3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)).logits
    np.testing.assert_allclose(np.asarray(ours), b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_load_save_load_is_bit_identical(hf_checkpoint, tmp_path, dtype):
    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path, dtype=dtype)
    save_pretrained(config, params, tmp_path / "a")
    config2, params2 = load_pretrained(tmp_path / "a", dtype=dtype)
    assert config2 == config
    with open(tmp_path / "a" / "config.json") as f:  # the dtype the weights are stored in
        assert json.load(f)["torch_dtype"] == jnp.dtype(dtype).name
    save_pretrained(config, jax.tree.map(lambda x: x.astype(jnp.float16), params), tmp_path / "h")
    with open(tmp_path / "h" / "config.json") as f:
        assert json.load(f)["torch_dtype"] == "float16"
    a, b = _flat(params), _flat(params2)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == dtype
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def test_sharded_save_and_load(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    save_pretrained(config, params, tmp_path / "s", max_shard_bytes=20_000)
    files = sorted(os.listdir(tmp_path / "s"))
    assert "model.safetensors.index.json" in files and "model.safetensors" not in files
    assert sum(f.endswith(".safetensors") for f in files) > 2
    _, params2 = load_pretrained(tmp_path / "s")
    for k, v in _flat(params).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(_flat(params2)[k]))
    reloaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "s")
    assert reloaded.config.num_hidden_layers == config.num_hidden_layers


def test_config_validation_and_from_hf_errors(tmp_path):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=3, num_key_value_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="divisible by num_key_value_heads.*3 heads and 2 kv heads"):
        Qwen3Config(**base)
    with pytest.raises(ValueError, match="hidden_size must be a positive int, got 0"):
        Qwen3Config(**{**base, "num_attention_heads": 2, "hidden_size": 0})
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        Qwen3Config.from_hf({**base, "model_type": "llama"})
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        Qwen3Config.from_hf({**base, "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unsupported rope_parameters type 'linear'"):
        Qwen3Config.from_hf({**base, "num_attention_heads": 2, "rope_parameters": {"rope_type": "linear"}})
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Qwen3Config.from_hf(tmp_path)
    ok = {**base, "num_attention_heads": 2}
    for field, value, message in (
            ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),  # would run SiLU silently
            ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),  # bool("false")
            ("attention_bias", 1, "attention_bias must be true or false, got 1"),
            ("rope_scaling", "linear", "rope_scaling must be an object"),
            ("rms_norm_eps", None, "rms_norm_eps must be a number, got None"),
            ("kvpop", {}, "'kvpop' is empty"), ("dms", {}, "'dms' is empty")):
        with pytest.raises(ValueError, match=message):
            Qwen3Config.from_hf({**ok, field: value})
    assert Qwen3Config.from_hf({**ok, "kvpop": None, "hidden_act": "silu"}).kvpop is None
    # The dataclasses themselves (a notebook builds them directly), and the kvpop block's own booleans.
    for field, value, message in (
            ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
            ("head_dim", 5, "head_dim must be even"),
            ("rope_theta", float("inf"), "rope_theta must be a finite number > 0, got inf"),
            ("rope_theta", "1e6", "rope_theta must be a finite number > 0, got '1e6'"),
            ("eos_token_id", [3, "4"], "eos_token_id holds '4'; expected token ids"),
            ("bos_token_id", 1.0, "bos_token_id holds 1.0")):
        with pytest.raises(ValueError, match=message):
            Qwen3Config(**{**ok, field: value})
    for field, value in (("eos_token_id", 10), ("bos_token_id", -1)):  # an odd checkpoint still loads, with a word
        with pytest.warns(UserWarning, match=f"{field} holds {value} outside the vocabulary \\[0, 10\\)"):
            Qwen3Config(**{**ok, field: value})
    assert Qwen3Config(**{**ok, "eos_token_id": [3, 9], "bos_token_id": 0}).eos_token_id == (3, 9)
    numpy_made = Qwen3Config(**{**ok, "tie_word_embeddings": np.bool_(True), "eos_token_id": np.array([1, 2]),
                                "bos_token_id": np.int64(0), "hidden_size": np.int64(8), "head_dim": np.int32(4),
                                "dms": DMSConfig(window=np.int64(8), budget=np.int32(16))})
    # numpy values become Python ones, JSON can write them (a numpy size was "must be a positive int, got
    # np.int64(8)")
    assert numpy_made.eos_token_id == (1, 2) and type(numpy_made.bos_token_id) is int
    assert type(numpy_made.hidden_size) is int and type(numpy_made.dms.window) is int
    assert numpy_made == Qwen3Config(**{**ok, "tie_word_embeddings": True, "eos_token_id": [1, 2], "bos_token_id": 0,
                                        "dms": DMSConfig(window=8, budget=16)})
    assert json.loads(json.dumps(numpy_made.to_hf()))["tie_word_embeddings"] is True
    for field in ("delayed_readout", "mlstm_skip", "count_normalize"):
        block = {**KVpopConfig().to_dict(), field: "false"}
        with pytest.raises(ValueError, match=f"KVpopConfig.{field} must be true or false, got 'false'"):
            Qwen3Config.from_hf({**ok, "kvpop": block})


@pytest.mark.parametrize("dtype", ["bf16", "int8", None])
def test_load_pretrained_names_a_dtype_that_is_not_a_float(hf_checkpoint, dtype):
    path, _ = hf_checkpoint("g4_bias")
    with pytest.raises(ValueError, match=f"dtype={dtype!r}: the params load as one of"):
        load_pretrained(path, dtype)
    assert jax.tree.leaves(load_pretrained(path, "bfloat16")[1])[0].dtype == jnp.bfloat16  # names are fine


def test_non_finite_weights_are_refused_at_load(tmp_path, hf_checkpoint):
    """A NaN in a weight (a scorer's: the policy would silently keep the oldest tokens) is named."""
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("g1_tied")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(path):
        if not f.endswith(".safetensors"):
            (bad / f).write_bytes(open(os.path.join(path, f), "rb").read())
    for f in (f for f in os.listdir(path) if f.endswith(".safetensors")):
        tensors = load_file(os.path.join(path, f))
        name = sorted(tensors)[len(tensors) // 2]
        tensors[name] = tensors[name].copy()
        tensors[name].flat[3] = np.inf
        save_file(tensors, str(bad / f))
    with pytest.raises(ValueError, match=rf"tensor '{name}' in .* holds NaN or infinite values"):
        load_pretrained(bad)


def test_fingerprint_agrees_for_copies_and_differs_for_other_weights(tmp_path, hf_checkpoint):
    import shutil

    from safetensors.numpy import load_file, save_file

    from kvpop_jax.checkpoint import checkpoint_fingerprint

    path, _ = hf_checkpoint("g1_tied")
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(path)
    rng = np.random.default_rng(0)
    for f in (f for f in os.listdir(copy) if f.endswith(".safetensors")):
        tensors = {k: v + (1e-3 * rng.normal(size=v.shape)).astype(v.dtype)
                   for k, v in load_file(str(copy / f)).items()}  # noised throughout, same shapes
        save_file(tensors, str(copy / f))
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(path)


def test_missing_directory_config_and_weights(tmp_path, hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(empty)
    path, _ = hf_checkpoint("g2_untied")
    for load in (load_pretrained, check_checkpoint):  # its config.json given for the folder was called missing
        with pytest.raises(FileNotFoundError, match=r"config.json' is a file; pass the folder that holds it"):
            load(os.path.join(path, "config.json"))
    os.unlink(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_pretrained(path)


def test_pickles_are_refused(tmp_path, hf_checkpoint):
    path, model = hf_checkpoint("g2_untied")
    os.unlink(os.path.join(path, "model.safetensors"))
    torch.save(model.state_dict(), os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"pickle weights \['pytorch_model.bin'\].*safe_serialization=True"):
        load_pretrained(path)


def test_missing_unexpected_and_shape_mismatch(tmp_path, hf_checkpoint):
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("g2_untied")
    weights = load_file(os.path.join(path, "model.safetensors"))
    fn = os.path.join(path, "model.safetensors")

    w = dict(weights)
    del w["model.layers.1.mlp.up_proj.weight"]
    w["model.layers.1.mlp.extra.weight"] = np.ones(3, np.float32)
    save_file(w, fn)
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\], "
                                         r"unexpected tensors \['model.layers.1.mlp.extra.weight'\]"):
        load_pretrained(path)

    w = dict(weights)
    w["model.layers.0.self_attn.k_proj.weight"] = np.ones((32, 48), np.float32)
    save_file(w, fn)
    with pytest.raises(ValueError, match=r"shape mismatch for tensor 'model.layers.0.self_attn.k_proj.weight': "
                                         r"expected \(64, 48\) from config.json, got \(32, 48\)"):
        load_pretrained(path)


def test_corrupt_header_and_index(tmp_path, hf_checkpoint):
    path, _ = hf_checkpoint("g2_untied")
    fn = os.path.join(path, "model.safetensors")
    with open(fn, "r+b") as f:
        f.seek(8)
        f.write(b"{garbage!!")
    with pytest.raises(ValueError, match="corrupt safetensors file"):
        load_pretrained(path)
    os.unlink(fn)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors.*does not exist"):
        load_pretrained(path)
    for index in ({"weight_map": ["model.norm.weight"]}, {"weight_map": {"model.norm.weight": None}}, [1, 2]):
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        with pytest.raises(ValueError, match="corrupt safetensors index"):
            load_pretrained(path)


# --- issue 13: exports are atomic, scoped to the library's own files, and validated first -----


def _params_equal(a, b):
    fa, fb = _flat(a), _flat(b)
    return fa.keys() == fb.keys() and all(np.array_equal(np.asarray(fa[k]), np.asarray(fb[k])) for k in fa)


def _scaled(params, factor):
    return jax.tree.map(lambda x: x * factor, params)


@pytest.mark.filterwarnings("ignore:.*kept weight files")
def test_resave_keeps_user_files_and_removes_only_its_own_stale_files(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    out = tmp_path / "export"
    save_pretrained(config, params, out)  # single file
    user = {"model-backup.safetensors": b"backup", "model_v1.safetensors": b"v1", "notes.txt": b"mine"}
    for name, data in user.items():
        (out / name).write_bytes(data)
    (out / "runs").mkdir()
    (out / "runs" / "log.txt").write_text("a user sub-folder")
    with pytest.warns(UserWarning, match="model-backup.safetensors"):  # look-alike weights are kept, with a warning
        save_pretrained(config, _scaled(params, 2.0), out, max_shard_bytes=20_000)  # now sharded
    files = set(os.listdir(out))
    assert "model.safetensors" not in files  # the first export's own file is stale: removed
    assert "model.safetensors.index.json" in files and sum(f.startswith("model-0") for f in files) > 2
    for name, data in user.items():
        assert (out / name).read_bytes() == data, name
    assert (out / "runs" / "log.txt").read_text() == "a user sub-folder"
    assert _params_equal(load_pretrained(out)[1], _scaled(params, 2.0))
    save_pretrained(config, params, out, extra_files={"tokenizer.json": str(out / "notes.txt")})  # back to one file
    files = set(os.listdir(out))
    assert "model.safetensors" in files and not any(f.startswith("model-0") for f in files)
    assert "model.safetensors.index.json" not in files and {*user, "tokenizer.json"} <= files
    (out / "notes.txt").write_bytes(b"mine, edited")  # the export's copy of it must not follow
    with pytest.warns(UserWarning, match="kept the previous export's tokenizer files"):
        save_pretrained(config, _scaled(params, 3.0), out)  # a re-save naming no tokenizer keeps the one it had
    assert (out / "tokenizer.json").read_bytes() == b"mine" and (out / "notes.txt").read_bytes() == b"mine, edited"
    assert "tokenizer.json" in json.loads((out / "kvpop_export.json").read_text())["files"]
    assert _params_equal(load_pretrained(out)[1], _scaled(params, 3.0))
    (out / "config_src.json").write_text("{}")  # a new tokenizer of one file replaces the old one whole: no mix
    save_pretrained(config, params, out, extra_files={"tokenizer_config.json": str(out / "config_src.json")})
    assert "tokenizer.json" not in os.listdir(out) and (out / "tokenizer_config.json").read_text() == "{}"
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".export")]  # no temporaries left


def test_a_killed_export_leaves_the_old_one_loadable(hf_checkpoint, tmp_path, monkeypatch):
    from kvpop_jax import fileio

    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    for shard_bytes in (4 * 1024**3, 20_000):  # single file, sharded
        out = tmp_path / f"export_{shard_bytes}"
        save_pretrained(config, params, out, max_shard_bytes=shard_bytes)
        before = sorted(os.listdir(out))
        real, calls = fileio.write_synced, []

        def dies_on_third_file(filename, data):
            calls.append(filename)
            if len(calls) == 3:
                raise KeyboardInterrupt("killed")  # what a SIGINT does; SIGKILL leaves only the temporary
            return real(filename, data)

        monkeypatch.setattr(fileio, "write_synced", dies_on_third_file)
        with pytest.raises(KeyboardInterrupt):
            save_pretrained(config, _scaled(params, 3.0), out, max_shard_bytes=shard_bytes)
        monkeypatch.setattr(fileio, "write_synced", real)
        assert sorted(os.listdir(out)) == before
        assert _params_equal(load_pretrained(out)[1], params)
    # a temporary left by a SIGKILLed export (its PID is gone) is cleaned up by the next export
    stale = tmp_path / ".export_20000.tmp-999999999-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    save_pretrained(config, params, tmp_path / "export_20000")
    assert not stale.exists()


@pytest.mark.parametrize("break_params, message", [
    (lambda f: f.pop("layers_1/mlp/up_proj/kernel"), r"missing \['layers_1/mlp/up_proj/kernel'\]"),
    (lambda f: f.update({"layers_0/mlp/extra/kernel": np.ones(3, np.float32)}),
     r"unexpected \['layers_0/mlp/extra/kernel'\]"),
    (lambda f: f.update({"norm/scale": np.ones(5, np.float32)}), r"'norm/scale' has shape \(5,\).*\(64,\)"),
    (lambda f: f.update({"norm/scale": np.ones(64, np.int32)}), r"'norm/scale' has dtype int32"),
    (lambda f: f.update({"norm/scale": np.full(64, np.nan, np.float32)}), r"'norm/scale' has 64 non-finite"),
])
def test_save_validates_the_params_tree_before_writing(hf_checkpoint, tmp_path, break_params, message):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    out = tmp_path / "export"
    save_pretrained(config, params, out)
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    flat = {k: np.asarray(v) for k, v in _flat(params).items()}
    break_params(flat)
    with pytest.raises(ValueError, match=message):
        save_pretrained(config, traverse_util.unflatten_dict(flat, sep="/"), out)
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before
    with pytest.raises(ValueError, match=message):
        save_pretrained(config, traverse_util.unflatten_dict(flat, sep="/"), tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


def test_config_json_that_is_not_an_object_or_lacks_a_field_names_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json.*is not a JSON object \(got list\)"):
        Qwen3Config.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10, "num_attention_heads": 2}))
    with pytest.raises(ValueError, match=r"config.json.*lacks the required field 'hidden_size'"):
        Qwen3Config.from_hf(tmp_path)
    with pytest.raises(ValueError, match=r"config lacks the required field 'hidden_size'"):
        Qwen3Config.from_hf({"vocab_size": 10})


def test_resave_without_an_atomic_exchange_still_replaces_the_export(hf_checkpoint, tmp_path, monkeypatch):
    from kvpop_jax import fileio

    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path)
    save_pretrained(config, params, tmp_path / "export")
    monkeypatch.setattr(fileio, "rename_exchange", lambda a, b: False)  # e.g. macOS: two renames
    save_pretrained(config, _scaled(params, 2.0), tmp_path / "export")
    assert _params_equal(load_pretrained(tmp_path / "export")[1], _scaled(params, 2.0))
    assert sorted(os.listdir(tmp_path)) == ["export", "hf_g2_untied_0"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_get_the_mode_a_plain_open_would(tmp_path, umask):
    """Not mkstemp's 0600: reports and exports on a shared cluster stay readable per the umask."""
    from kvpop_jax.fileio import atomic_write_bytes, current_umask

    old = os.umask(umask)
    try:
        assert current_umask() == umask
        atomic_write_bytes(str(tmp_path / "atomic.md"), b"x")
        with open(tmp_path / "plain.md", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = lambda name: os.stat(tmp_path / name).st_mode & 0o777  # noqa: E731
    assert mode("atomic.md") == mode("plain.md") == 0o666 & ~umask
    assert (tmp_path / "atomic.md").read_bytes() == b"x"


def test_an_export_path_that_is_or_lies_under_a_file_is_named(hf_checkpoint, tmp_path):
    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path)
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(NotADirectoryError, match="it exists and is not a directory"):
        save_pretrained(config, params, tmp_path / "afile")
    with pytest.raises(NotADirectoryError, match=r"'.*afile' on its way is a file, not a directory"):
        save_pretrained(config, params, tmp_path / "afile" / "sub" / "export")
    assert (tmp_path / "afile").read_text() == "mine"


def test_an_export_that_would_replace_the_working_directory_is_refused(hf_checkpoint, tmp_path, monkeypatch):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    work = tmp_path / "notebook"
    (work / "data").mkdir(parents=True)
    (work / "data" / "mine.txt").write_text("mine")
    monkeypatch.chdir(work / "data")
    for target, message in [("", "empty path"), (".", "is the working directory"), (str(work), "holds the working"),
                            ("..", "holds the working")]:
        with pytest.raises(ValueError, match=message):
            save_pretrained(config, params, target)
    assert os.getcwd() == str((work / "data").resolve()) and (work / "data" / "mine.txt").read_text() == "mine"
    assert sorted(os.listdir(work)) == ["data"] and os.listdir(work / "data") == ["mine.txt"]
    save_pretrained(config, params, "export")  # a folder of its own inside the working directory is fine
    assert _params_equal(load_pretrained(work / "data" / "export")[1], params)


def test_an_export_that_would_replace_home_or_a_mounted_file_system_is_refused(hf_checkpoint, tmp_path, monkeypatch):
    """The swap re-links every entry of the old folder into the new one and deletes the old: over the home folder
    other shells are left in a deleted folder; over a mount point the mounted file system is copied, then emptied."""
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    home = tmp_path / "home"
    (home / "notes").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ValueError, match=r"is your home folder"):
        save_pretrained(config, params, home)  # what --export_dir ~ gives once the shell has expanded it
    assert sorted(os.listdir(home)) == ["notes"]
    out = tmp_path / "export"
    (out / "disk" / "data").mkdir(parents=True)
    (out / "disk" / "data" / "big.bin").write_text("on another disk")
    mounted = str(out / "disk")
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == mounted or real_ismount(p))
    with pytest.raises(ValueError, match=rf"holds a mount point \({mounted}\): replacing the folder would copy"):
        save_pretrained(config, params, out)
    assert (out / "disk" / "data" / "big.bin").read_text() == "on another disk" and sorted(os.listdir(out)) == ["disk"]
    monkeypatch.setattr(os.path, "ismount", real_ismount)
    save_pretrained(config, params, out)  # the same folder, no mount: the export goes in beside the user's files
    assert (out / "disk" / "data" / "big.bin").read_text() == "on another disk"


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                                  "model.safetensors.index.json", "kvpop_export.json"])
def test_extra_files_cannot_take_the_exports_own_names(hf_checkpoint, tmp_path, name):
    path, _ = hf_checkpoint("g4_bias")
    config, params = load_pretrained(path)
    src = tmp_path / "notes.txt"
    src.write_text("not a weight file")
    with pytest.raises(ValueError, match=f"extra file '{name}'.*writes that name itself"):
        save_pretrained(config, params, tmp_path / "export", extra_files={name: str(src)})
    assert not (tmp_path / "export").exists()
    with pytest.raises(TypeError, match=r"extra_files maps each file's name in the checkpoint to its source path.*"
                                        r"got list"):  # was "dictionary update sequence element #0 has length 39"
        save_pretrained(config, params, tmp_path / "export", extra_files=[str(src)])
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("rope", [
    {},  # no RoPE field at all: transformers' base is 10000, not Qwen3's usual 1e6
    {"rope_theta": 500_000.0},  # transformers 4.x
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 10.0},  # the dict's comes first
    {"rope_parameters": {"rope_type": "default"}, "rope_theta": 500_000.0},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": {"rope_type": "default"},
     "rope_theta": 20_000.0},  # a non-empty rope_scaling replaces rope_parameters
])
@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="reads transformers 5's rope_parameters (4.x reads rope_theta and rope_scaling)")
def test_rope_theta_is_read_as_transformers_reads_it(rope):
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, head_dim=4)
    theirs = transformers.Qwen3Config(**base, **rope).rope_parameters["rope_theta"]
    assert Qwen3Config.from_hf({**base, **rope}).rope_theta == theirs


def test_rope_parameters_per_layer_type_are_refused_not_ignored():
    """{"full_attention": {"rope_type": "linear", ...}} has no rope_type at its top: it read as plain RoPE."""
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                head_dim=4)
    nested = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}
    with pytest.raises(ValueError, match=r"rope_parameters per layer type \(\['full_attention'\]\) is not supported"):
        Qwen3Config.from_hf({**base, "rope_parameters": nested})


def test_a_null_num_key_value_heads_means_one_per_head_as_in_transformers():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                head_dim=4, num_key_value_heads=None)
    assert Qwen3Config.from_hf(base).num_key_value_heads == transformers.Qwen3Config(**base).num_key_value_heads == 2


def test_a_missing_head_dim_is_read_as_transformers_reads_it_or_refused():
    """transformers' Qwen3Config defaults head_dim to 128; it was read as hidden_size // num_attention_heads, so a
    hand-written config without it was another model here (16 against 128; Qwen3-4B's shape: 80 against 128)."""
    base = dict(vocab_size=10, intermediate_size=8, num_hidden_layers=1, num_key_value_heads=2)
    for hidden, heads in ((64, 4), (2560, 32)):
        with pytest.raises(ValueError, match=rf"no head_dim; transformers reads a Qwen3 config without one as "
                                             rf"head_dim 128, not hidden_size // num_attention_heads = "
                                             rf"{hidden // heads}: give head_dim explicitly"):
            Qwen3Config.from_hf({**base, "hidden_size": hidden, "num_attention_heads": heads})
    same = {**base, "hidden_size": 512, "num_attention_heads": 4}  # both readings agree
    assert Qwen3Config.from_hf(same).head_dim == transformers.Qwen3Config(**same).head_dim == 128
    with pytest.raises(ValueError, match="head_dim must be an int, got None"):  # transformers 5 refuses it too
        Qwen3Config.from_hf({**same, "head_dim": None})
    for heads in (0, "4", 4.0):  # the bad field is named, not a head_dim "hidden_size // heads = None"
        with pytest.raises(ValueError, match=f"num_attention_heads must be a positive int, got {heads!r}"):
            Qwen3Config.from_hf({**same, "num_attention_heads": heads})


def test_a_tied_checkpoint_storing_a_different_lm_head_is_refused(hf_checkpoint, tmp_path, rng, monkeypatch):
    """transformers unties such a checkpoint and its logits use the stored head; the tied params would use
    the embedding, silently. A stored head equal to the embedding loads as before."""
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("g1_tied")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    other = embed.copy()
    other[-1, 0] += 1.0  # in the last of the row chunks compared
    monkeypatch.setattr("kvpop_jax.checkpoint.TIED_CHECK_ROWS", 7)
    for name, head in (("same", embed.copy()), ("other", other)):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_text(open(os.path.join(path, "config.json")).read())
        save_file({**tensors, "lm_head.weight": head}, str(out / "model.safetensors"), metadata={"format": "pt"})
        ids = torch.tensor(rng.integers(0, embed.shape[0], size=(1, 9)))
        with torch.no_grad():
            theirs = transformers.Qwen3ForCausalLM.from_pretrained(out).eval()(ids).logits.numpy()
        if name == "other":
            with pytest.raises(ValueError, match="tie_word_embeddings=true but the stored 'lm_head.weight' differs"):
                load_pretrained(out)
            continue
        config, params = load_pretrained(out)
        ours = Qwen3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids.numpy())).logits
        np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)


def test_a_folder_with_both_a_single_file_and_an_index_is_refused(hf_checkpoint, tmp_path):
    """transformers loads model.safetensors and ignores the index (its own sharded save into an old folder
    leaves such a pair); loading the shards instead gave another model, silently."""
    path, model = hf_checkpoint("g2_untied")
    model.save_pretrained(path, max_shard_size="20KB")  # transformers keeps the old model.safetensors
    assert {"model.safetensors", "model.safetensors.index.json"} <= set(os.listdir(path))
    with pytest.raises(ValueError, match="holds both model.safetensors and model.safetensors.index.json"):
        load_pretrained(path)


def test_a_sharded_export_beside_a_foreign_single_file_is_refused_before_writing(hf_checkpoint, tmp_path):
    """A model.safetensors the export did not write would be what transformers loads (over the new index)."""
    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path)
    out = tmp_path / "out"
    save_pretrained(config, params, out, max_shard_bytes=20_000)
    foreign = open(os.path.join(path, "model.safetensors"), "rb").read()
    (out / "model.safetensors").write_bytes(foreign)
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match="holds a model.safetensors this library did not write, and transformers "
                                         "would load it over the new model.safetensors.index.json"):
        save_pretrained(config, params, out, max_shard_bytes=20_000)
    assert sorted(os.listdir(out)) == before and (out / "model.safetensors").read_bytes() == foreign
    save_pretrained(config, params, out)  # a single-file export replaces it, as before
    load_pretrained(out)
    single = tmp_path / "single"  # and a foreign index beside a single-file export: a folder both loaders refuse
    save_pretrained(config, params, single)
    (single / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(ValueError, match="holds a model.safetensors.index.json this library did not write, and "
                                         "beside the new model.safetensors it makes the folder one that "
                                         "load_pretrained and kvpop_torch refuse"):
        save_pretrained(config, params, single)


def test_an_export_over_files_no_manifest_lists_says_what_it_replaces(hf_checkpoint, tmp_path):
    """Exporting into a HF model folder (or any folder holding a config.json) replaced its weights and config
    silently; a re-save of a kvpop export (with its manifest) stays quiet."""
    import warnings as warnings_module

    path, _ = hf_checkpoint("g2_untied")
    config, params = load_pretrained(path)
    with pytest.warns(UserWarning, match=r"replacing \['config.json', 'model.safetensors'\], which no "
                                         r"kvpop_export.json lists"):
        save_pretrained(config, params, path)
    with warnings_module.catch_warnings():
        warnings_module.simplefilter("error")
        save_pretrained(config, params, path)


def test_a_base_model_checkpoint_is_named_in_a_short_message(tmp_path):
    """A Qwen3Model save (no lm_head, names without 'model.') listed every tensor twice: ~1,000 characters a
    layer, one unreadable line for a real model. Now a few names, the count of the rest and what it is."""
    kwargs = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32)
    transformers.Qwen3Model(transformers.Qwen3Config(**kwargs)).save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match=r"missing tensors \[.*\] and 61 more, unexpected tensors \[.*\] and 60 more "
                                         r"\(no 'model.' prefix and no lm_head: a base Qwen3Model's") as e:
        load_pretrained(tmp_path / "base")
    assert len(str(e.value)) < 1500


def test_a_weight_that_overflows_the_load_dtype_is_refused(hf_checkpoint):
    """The finite check ran on the file's values only: a float32 1e5 loaded as float16 became inf, silently."""
    from safetensors.numpy import load_file, save_file

    path, _ = hf_checkpoint("g2_untied")
    fn = os.path.join(path, "model.safetensors")
    weights = load_file(fn)
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = 1e5
    save_file(weights, fn, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' in .* holds values beyond "
                                         r"the range of float16 \(max 100000\)"):
        load_pretrained(path, dtype=jnp.float16)
    load_pretrained(path, dtype=jnp.bfloat16)


@pytest.mark.parametrize("overrides, sliding", [
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=28), False),  # every layer below 28: full
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), True),  # layer 1 on slides
    (dict(use_sliding_window=False, sliding_window=8, max_window_layers=0), False),
    (dict(hidden_act="swish"), False),  # transformers' ACT2FN runs SiLU for it
])
def test_sliding_layers_and_the_activation_are_read_as_transformers_reads_them(hf_checkpoint, rng, overrides,
                                                                              sliding):
    """A config.json with use_sliding_window: true but every layer below max_window_layers is full attention
    in transformers (its layer_types say so), and 'swish' is SiLU: both were refused. A layer that does slide
    is refused, naming the fields; the others load with transformers' logits."""
    path, torch_model = hf_checkpoint("g2_untied", **overrides)
    hf = json.load(open(os.path.join(path, "config.json")))
    assert ("sliding_attention" in hf["layer_types"]) == sliding  # what transformers derived
    without_types = {k: v for k, v in hf.items() if k != "layer_types"}  # a transformers 4 config.json: derived
    assert ("sliding_attention" in hf_layer_types(without_types)) == sliding
    if sliding:
        for config in (hf, without_types):
            with pytest.raises(ValueError, match=r"unsupported sliding-window layers \(use_sliding_window=True, "
                                                 r"sliding_window=8, max_window_layers=1"):
                Qwen3Config.from_hf(config)
        return
    config, params = load_pretrained(path)
    assert Qwen3Config.from_hf(without_types) == config
    ids = rng.integers(0, config.vocab_size, size=(2, 11))
    with torch.no_grad():
        want = torch_model(torch.tensor(ids)).logits.numpy()
    got = Qwen3ForCausalLM(config).apply({"params": params}, jnp.asarray(ids)).logits
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def test_an_unreadable_max_window_layers_is_refused_not_guessed():
    hf = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=4, use_sliding_window=True, sliding_window=8, max_window_layers="2")
    with pytest.raises(ValueError, match="max_window_layers='2'"):
        Qwen3Config.from_hf(hf)


def test_a_tokenizer_naming_custom_code_is_refused_without_running_it(tmp_path, monkeypatch):
    """An `auto_map` in tokenizer_config.json names Python files of the folder: transformers asked on
    stdin whether to run them, and a "y" ran them. Nothing runs code from a checkpoint: refused, unasked."""
    from demo.tokenizer import save_tokenizer
    from kvpop_jax.checkpoint import load_tokenizer

    save_tokenizer(tmp_path)
    ran = tmp_path / "ran"
    (tmp_path / "custom.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
                                        "from transformers import PreTrainedTokenizerFast\n\n\n"
                                        "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": [None, "custom.CustomTokenizer"]})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr("builtins.input", lambda prompt="": "y")  # what a user at the prompt might answer
    with pytest.raises(ValueError, match="no tokenizer could be loaded from .*custom code"):
        load_tokenizer(tmp_path)
    assert not ran.exists()


@pytest.mark.parametrize("elsewhere", ["../outside.safetensors", "ABSOLUTE"])
def test_an_index_naming_a_shard_outside_its_folder_is_refused(hf_checkpoint, tmp_path, elsewhere):
    """An untrusted index sent the loader to read any file ('../x', an absolute path) as a shard."""
    from safetensors.numpy import load_file

    path, _ = hf_checkpoint("g2_untied")
    outside = os.path.join(os.path.dirname(path), "outside.safetensors")
    os.replace(os.path.join(path, "model.safetensors"), outside)
    shard = outside if elsewhere == "ABSOLUTE" else elsewhere
    weight_map = {name: shard for name in load_file(outside)}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    for load in (load_pretrained, check_checkpoint):
        with pytest.raises(ValueError, match=f"shard '{shard}' is not a file name in"):
            load(path)


def test_hostile_sizes_in_config_json_are_named_before_anything_is_built(hf_checkpoint):
    """An untrusted config.json is held to the weights before the expected params are built from it: a
    huge num_hidden_layers built them layer by layer (hours, gigabytes) before naming the missing tensors,
    a huge width allocated its shape (a MemoryError traceback), and a size past int32 was an OverflowError
    traceback from inside jax naming no field."""
    path, _ = hf_checkpoint("g2_untied")
    with open(os.path.join(path, "config.json")) as f:
        original = json.load(f)
    cases = [({"num_attention_heads": 2**30}, r"shape mismatch for tensor 'model.layers.0.self_attn.[qo]_proj.weight'"
                                              r": expected \(.*34359738368.*\) from config.json"),
             ({"num_hidden_layers": 1000}, "the config has num_hidden_layers=1000, the weights hold 2 layers"),
             ({"vocab_size": 10**12}, r"Qwen3Config.vocab_size must be at most 2\*\*31 - 1"),
             ({"kvpop": {"topk": 10**12}}, r"KVpopConfig.topk must be at most 2\*\*31 - 1")]
    for change, message in cases:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**original, **change}, f)
        with pytest.raises(ValueError, match=message):
            check_checkpoint(path)


def test_a_config_json_that_is_binary_nested_too_deep_or_has_odd_layer_types_is_named(tmp_path):
    """Each was a bare traceback naming no file (UnicodeDecodeError, RecursionError, TypeError: 'int'
    object is not iterable)."""
    path = tmp_path / "config.json"
    for content, message in ((b"\xff\xfe{}", "is not valid JSON: 'utf-8' codec"),
                             (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON: maximum recursion depth")):
        path.write_bytes(content)
        with pytest.raises(ValueError, match=f"config.json at .*config.json' {message}"):
            Qwen3Config.from_hf(tmp_path)
    hf = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=2, head_dim=4, layer_types=5)
    with pytest.raises(ValueError, match="layer_types must be a list of each layer's attention, got 5"):
        Qwen3Config.from_hf(hf)


def test_a_weight_stored_as_an_integer_bool_or_float8_is_refused_by_name(hf_checkpoint):
    """int8 / bool weights of the right name and shape were cast to float silently (a quantized tensor
    without its scale), float8 ones a bare AttributeError from numpy."""
    from safetensors.torch import load_file, save_file

    path, _ = hf_checkpoint("g2_untied")
    fn = os.path.join(path, "model.safetensors")
    weights = load_file(fn)
    for dtype, stored in ((torch.int8, "I8"), (torch.bool, "BOOL"), (torch.float8_e4m3fn, "F8_E4M3")):
        save_file({**weights, "model.norm.weight": weights["model.norm.weight"].to(dtype)}, fn)
        for load in (load_pretrained, check_checkpoint):
            with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' is stored as {stored}; expected one of"):
                load(path)
