"""Run profiles: the built-ins load, and every wrong key or value names file, key and what is allowed."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from flashprefill.config import SparseConfig
from fpcli.profiles import (
    Profile,
    ProfileError,
    builtin_profiles,
    load_profile,
    profile_from_dict,
    profiles_dir,
    with_precision,
)


def test_builtins_load():
    assert {"bf16", "fp8", "dense"} <= set(builtin_profiles())
    bf16, fp8, dense = load_profile("bf16"), load_profile("fp8"), load_profile("dense")
    assert bf16.precision == "bf16" and fp8.precision == "fp8"
    assert bf16.attention == fp8.attention == "flashprefill" and dense.is_dense
    assert isinstance(bf16.sparse_config(), SparseConfig)
    assert bf16.engine.chunked_prefill_size >= 8192
    assert bf16.source == profiles_dir() / "bf16.yaml"


def test_profile_is_frozen_and_replace_validates():
    p = load_profile("bf16")
    with pytest.raises(Exception):
        p.precision = "fp8"  # type: ignore[misc]
    assert p.replace(precision="fp8").precision == "fp8"
    with pytest.raises(ProfileError, match="precision"):
        p.replace(precision="int4")


def test_the_builtin_bf16_and_fp8_profiles_are_twins_and_with_precision_swaps_them():
    """with_precision relies on it: the built-in fp8 profile is the bf16 one at fp8 precision."""
    bf16, fp8 = load_profile("bf16"), load_profile("fp8")
    same = {k: v for k, v in bf16.to_dict().items() if k not in ("name", "description", "precision", "source")}
    assert same == {k: v for k, v in fp8.to_dict().items() if k not in ("name", "description", "precision", "source")}
    assert with_precision(bf16, "fp8") == fp8 and with_precision(fp8, "bf16") == bf16
    assert with_precision(bf16, "bf16") is bf16
    with pytest.raises(ProfileError, match="precision"):
        with_precision(bf16, "int4")


def test_with_precision_of_a_users_profile_keeps_its_settings(tmp_path):
    path = tmp_path / "bf16.yaml"  # a user's file named like a built-in is not the built-in
    path.write_text("name: bf16\nsparse:\n  alpha: 0.3\n")
    mine = load_profile(str(path))
    twin = with_precision(mine, "fp8")
    assert twin.name == "bf16+fp8" and twin.precision == "fp8" and twin.sparse == mine.sparse and twin.source == path
    assert with_precision(twin, "bf16") == mine  # back to the user's own profile, not "bf16+fp8+bf16"
    dense = with_precision(load_profile("dense"), "fp8")  # recorded as asked; the engines say it runs dense
    assert dense.is_dense and dense.name == "dense+fp8"


def test_a_twins_twin_is_named_for_its_precision_not_the_chain(tmp_path):
    """with_precision of a twin starts from the profile it came from: no name says a precision that
    does not run (accurate+int8qk+bf16 would be a BF16 row that reads int8qk)."""
    acc_i = load_profile("accurate+int8qk")
    assert with_precision(acc_i, "bf16") == load_profile("accurate")
    assert with_precision(acc_i, "fp8") == load_profile("accurate+fp8")
    assert load_profile("accurate+int8qk+fp8").name == "accurate+fp8"
    assert with_precision(load_profile("bf16+int8qk"), "fp8") == load_profile("fp8")
    path = tmp_path / "mine.yaml"  # a file changed since its twin was made: the twin's settings stay
    path.write_text("name: mine\nprecision: fp8\nsparse:\n  alpha: 0.3\n")
    twin = load_profile(f"{path}+int8qk")
    path.write_text("name: mine\nsparse:\n  alpha: 0.2\n")
    back = with_precision(twin, "bf16")
    assert (back.name, back.precision, back.sparse.alpha) == ("mine+bf16", "bf16", 0.3)
    assert with_precision(twin, "fp8").name == "mine+fp8"


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nsparse:\n  alpha: 0.2\n")
    p = load_profile(str(path))
    assert p.name == "mine" and p.sparse.alpha == 0.2 and p.sparse.block_size == 128
    assert p.to_dict()["source"] == str(path)


def write(tmp_path, data) -> str:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


@pytest.mark.parametrize(
    "data, key, allowed",
    [
        ({"name": "x", "colour": 1}, "unknown key 'colour'", "allowed: name, description"),
        ({"name": "x", "sparse": {"alfa": 0.1}}, "unknown key 'sparse.alfa'", "alpha"),
        ({"name": "x", "engine": {"pagesize": 1}}, "unknown key 'engine.pagesize'", "page_size"),
        ({"name": "x", "precision": "fp16"}, "precision: 'fp16'", "allowed: bf16, fp8"),
        ({"name": "x", "attention": "sparse"}, "attention: 'sparse'", "allowed: flashprefill, dense"),
        ({"name": "x", "sparse": {"alpha": 2.0}}, "sparse.alpha", "[0, 1]"),
        ({"name": "x", "sparse": {"threshold_max": "all"}}, "sparse.threshold_max", "prunable"),
        ({"name": "x", "sparse": {"block_score": "max"}}, "sparse.block_score", "mass"),
        ({"name": "x", "sparse": {"block_size": 96}}, "sparse.block_size", "(64, 128)"),
        ({"name": "x", "sparse": {"mean_correction": "yes"}}, "sparse.mean_correction", "bool"),
        ({"name": "x", "engine": {"chunked_prefill_size": 4096}}, "engine.chunked_prefill_size", ">= 8192"),
        ({"name": "x", "engine": {"mem_fraction_static": 1.5}}, "engine.mem_fraction_static", "(0, 1)"),
        ({"name": "x", "engine": {"dtype": "int8"}}, "engine.dtype: 'int8'", "allowed: auto, bfloat16"),
        ({"name": "x", "engine": {"cuda_graph_decode": 1}}, "engine.cuda_graph_decode", "must be bool"),
        ({"name": "x", "dense_layers": -1}, "dense_layers", ">= 0"),
        ({"name": "x", "dense_layers": True}, "dense_layers", "must be int"),
        ({"name": "x", "dense_layers": 2.0}, "dense_layers", "must be int (the first N layers) or a list"),
        ({"name": "x", "dense_layers": [0, -3]}, "dense_layers", "layer ids must be >= 0, got -3"),
        ({"name": "x", "dense_layers": ["11-8"]}, "dense_layers", "range '11-8' runs backwards: write 8-11"),
        ({"name": "x", "dense_layers": [0, "x"]}, "dense_layers", "'x' is not a layer id"),
        ({"name": "x", "dense_layers": [0, 1.5]}, "dense_layers", "1.5 is not a layer id"),
        ({"name": "x", "dense_layers": [1, 1]}, "dense_layers", "layer 1 is listed twice (1 and 1)"),
        ({"name": "x", "dense_layers": ["0-3", "2-5"]}, "dense_layers", "layer 2 is listed twice (0-3 and 2-5)"),
        ({"name": "x", "dense_layers": "0-1,1"}, "dense_layers", "layer 1 is listed twice (0-1 and 1)"),
        ({"name": "x", "engine": {"max_requests": 0}}, "engine.max_requests", ">= 1, got 0"),
        ({"name": "x", "engine": {"max_requests": 2.5}}, "engine.max_requests", "must be int"),
        ({"name": "x", "engine": {"kv_cache_tokens": 100}}, "engine.kv_cache_tokens", ">= 256 or absent, got 100"),
        ({"name": "x", "engine": {"kv_cache_tokens": True}}, "engine.kv_cache_tokens", "must be int"),
        ({"description": "no name"}, "missing key 'name'", ""),
    ],
)
def test_wrong_key_or_value_names_file_key_allowed(tmp_path, data, key, allowed):
    path = write(tmp_path, data)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    msg = str(info.value)
    assert msg.startswith(path), msg
    assert key in msg and allowed in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("text, layers, shown", [
    ("dense_layers: 12", 12, "12"),                                          # the first N, as always
    ("dense_layers: [0, 1, 8-11]", (0, 1, 8, 9, 10, 11), "[0-1, 8-11]"),    # YAML reads 8-11 as a string
    ("dense_layers: [8-11, 0-1]", (0, 1, 8, 9, 10, 11), "[0-1, 8-11]"),     # any order
    ("dense_layers: 0-1, 8-11", (0, 1, 8, 9, 10, 11), "[0-1, 8-11]"),       # one string
    ("dense_layers: [5]", (5,), "[5]"),
    ("dense_layers: [0-11]", 12, "12"),                                      # a prefix is its N
    ("dense_layers: [1, 0]", 2, "2"),
    ("dense_layers: []", 0, "0"),
])
def test_dense_layers_as_a_set_of_layers(tmp_path, text, layers, shown):
    """``dense_layers`` takes the first N (an int) or a list of layer ids and inclusive ranges;
    one form in the profile: an int for the first N, else the sorted tuple of ids."""
    path = tmp_path / "p.yaml"
    path.write_text(f"name: p\n{text}\n")
    prof = load_profile(path)
    assert prof.dense_layers == layers and prof.dense_layers_text == shown
    wanted = set(range(layers)) if isinstance(layers, int) else set(layers)
    assert {i for i in range(30) if prof.dense_layer(i)} == wanted


def test_a_set_of_dense_layers_keeps_its_precision_twin():
    """``precision_twins`` still pairs two profiles with the same set, and tells different sets
    apart; the settings row names a set by its ranges."""
    from fpcli.profiles import precision_twins, sparse_differences, sparse_settings

    bf16 = load_profile("bf16")
    mine = bf16.replace(name="mine", dense_layers=(0, 1, 8, 9, 10, 11))
    assert precision_twins(mine, with_precision(mine, "fp8"))
    assert not precision_twins(mine, with_precision(mine.replace(dense_layers=(0, 1, 8, 9, 10)), "fp8"))
    settings = sparse_settings(mine, 32768)
    assert settings["dense_layers"] == [0, 1, 8, 9, 10, 11]  # plain data: JSON has no tuples
    assert sparse_differences(settings, bf16) == ["dense_layers [0-1, 8-11]"]
    assert sparse_differences(sparse_settings(mine, 32768), mine) == []  # a list from JSON equals the tuple


def test_not_yaml_or_not_mapping(tmp_path):
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(ProfileError, match="expected a mapping"):
        load_profile(write(tmp_path, "- a\n- b\n"))


def test_a_directory_or_an_empty_file_says_so(tmp_path, monkeypatch):
    """--profile given a folder, an empty (or comments-only) YAML file or a binary file: one line
    naming the path and what is wrong (it was 'profile file not found' for an existing folder,
    'expected a mapping ..., got NoneType', or a UnicodeDecodeError traceback)."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    for given in (str(folder), f"{folder}/", str(tmp_path / "odd.yaml")):
        Path(given).mkdir(exist_ok=True)
        with pytest.raises(ProfileError) as info:
            load_profile(given)
        assert str(info.value) == f"profile {given}: is a directory; give a profile .yaml file or a built-in name"
    monkeypatch.chdir(tmp_path)  # a bare name that is a folder here and no built-in
    with pytest.raises(ProfileError, match=r"^profile profiles: is a directory"):
        load_profile("profiles")
    for text in ("", "\n\n", "# only a comment\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        with pytest.raises(ProfileError) as info:
            load_profile(empty)
        assert str(info.value) == f"{empty}: is empty (a profile needs at least 'name'; schema: docs/profiles.md)"
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\x00")
    with pytest.raises(ProfileError, match=rf"^{binary}: not a text file"):
        load_profile(binary)


def test_unknown_name_lists_builtins():
    with pytest.raises(ProfileError, match="unknown profile 'turbo'.*bf16"):
        load_profile("turbo")
    with pytest.raises(ProfileError, match="profile file not found"):
        load_profile("/nowhere/p.yaml")


def test_missing_profiles_dir_is_clear(monkeypatch):
    import fpcli.profiles as profiles

    monkeypatch.setattr(profiles, "BUILTIN_DIR", "no_such_folder")
    with pytest.raises(ProfileError, match="built-in profiles not found.*reinstall it.*--profile PATH"):
        load_profile("bf16")


def test_builtin_profiles_are_package_data():
    """Found through ``importlib.resources`` inside the ``fpcli`` package (a wheel carries them)."""
    import importlib.resources

    here = importlib.resources.files("fpcli") / "builtin_profiles"
    assert sorted(p.name for p in here.iterdir() if p.name.endswith(".yaml")) == \
        ["accurate.yaml", "bf16.yaml", "dense.yaml", "fp8.yaml"]
    assert load_profile("bf16").source == profiles_dir() / "bf16.yaml"


def test_accurate_is_bf16_with_its_early_layers_dense():
    """The ``accurate`` built-in differs from ``bf16`` only where docs/eval.md measured it ("Where
    the multi-key loss lives"): more dense layers and a larger alpha in the others; the engine
    settings and the rest of the method are bf16's, so a comparison of the two measures that alone."""
    import dataclasses

    acc, bf16 = load_profile("accurate"), load_profile("bf16")
    assert (acc.name, acc.attention, acc.precision) == ("accurate", "flashprefill", "bf16")
    assert acc.dense_layers == 12 > bf16.dense_layers and acc.sparse.alpha == 0.1 > bf16.sparse.alpha
    assert dataclasses.replace(acc.sparse, alpha=bf16.sparse.alpha) == bf16.sparse
    assert acc.engine == bf16.engine


def test_a_twin_at_another_precision_by_name(tmp_path):
    """``NAME+fp8`` / ``NAME+bf16`` load the profile at that precision (what ``fp bench --fp8`` runs
    beside it), for built-ins and paths; a file whose whole name ends so is that file; a precision
    that does not exist is an unknown profile whose message says what is allowed."""
    acc = load_profile("accurate+fp8")
    assert (acc.name, acc.precision) == ("accurate+fp8", "fp8")
    assert acc.replace(precision="bf16", name="accurate") == load_profile("accurate")  # nothing else changed
    assert load_profile("bf16+fp8") == load_profile("fp8")  # the built-in twins, by their own names
    assert load_profile("fp8+bf16") == load_profile("bf16")
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\ndense_layers: 3\n")
    twin = load_profile(f"{mine}+fp8")
    assert (twin.name, twin.precision, twin.dense_layers) == ("mine+fp8", "fp8", 3)
    odd = tmp_path / "odd+fp8"  # a file of that very name wins over the twin syntax
    odd.write_text("name: odd\n")
    assert load_profile(odd).name == "odd" and load_profile(str(odd)).precision == "bf16"
    with pytest.raises(ProfileError, match=r"unknown profile 'accurate\+fp16' .*NAME\+bf16, NAME\+fp8, NAME\+int8qk: "):
        load_profile("accurate+fp16")


def test_the_old_method_key_is_refused_with_its_new_name(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("name: old\noperator:\n  alpha: 0.2\n")
    with pytest.raises(ProfileError, match=rf"{path}: key 'operator' was renamed to 'sparse'"):
        load_profile(path)


def test_profile_from_dict_defaults():
    p = profile_from_dict({"name": "min"})
    assert p == Profile(name="min")
    assert p.engine.chunked_prefill_size == 16384


def test_invalid_yaml_names_line_and_column(tmp_path):
    path = write(tmp_path, "name: x\nsparse:\n  alpha: 0.1\n  bad: key: here\n")
    with pytest.raises(ProfileError, match=r"not valid YAML: line 4, column 11: mapping values are not allowed"):
        load_profile(path)


def test_sparse_threshold_fits_the_model_context():
    from fpcli.profiles import sparse_threshold

    p = load_profile("bf16")
    assert p.sparse.min_sparse_len == 8192
    small = p.fit_to_context(8192)  # the embedded SmolLM2-135M: 8K context
    assert small.sparse.min_sparse_len == 4096 == sparse_threshold(8192, 8192)
    assert small.sparse.alpha == p.sparse.alpha and small.name == p.name
    assert p.fit_to_context(32768) is p and p.fit_to_context(131072).sparse.min_sparse_len == 8192
    assert small.fit_to_context(8192) is small  # idempotent
    assert load_profile("dense").fit_to_context(8192).sparse.min_sparse_len == 0


def test_engine_pool_settings_load_from_yaml(tmp_path):
    path = write(tmp_path, {"name": "x", "engine": {"max_requests": 2, "kv_cache_tokens": 300000}})
    e = load_profile(path).engine
    assert (e.max_requests, e.kv_cache_tokens) == (2, 300000)
    bf16 = load_profile("bf16").engine
    assert bf16.max_requests == 8 and bf16.kv_cache_tokens is None  # the pool follows the context
