"""Bad input to the command line and the environment: one clear line (what, where, how to fix)
and a non-zero exit, never a traceback; typos are errors listing the known names."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from support import run_python

from mslk_dsl import cli, env, registry
from mslk_dsl.aot import manifest as aot_manifest

HERE = os.path.dirname(os.path.abspath(__file__))
MANIFEST = os.path.join(HERE, "fixtures", "manifests", "scale_copy.toml")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mslk-dsl: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def write_manifest(tmp_path, text: str) -> str:
    path = tmp_path / "m.toml"
    path.write_text(textwrap.dedent(text))
    return str(path)


# -- bad files ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,needles", [
    ("kernels = 5\n", ["kernels must be a list of [[kernels]] tables", "got 5"]),
    ("targets = \"sm90a\"\n", ["targets must be a list of target names"]),
    ("[[kernels]]\nop = 3\n", ["[[kernels]] #1 op must be"]),
    ("[[kernels]]\nop = \"scale_copy\"\nconfig = \"all\"\n", ["unknown field(s) ['config']", "configs"]),
    ("[[kernels]\n", ["not valid TOML"]),
])
def test_malformed_manifest_is_one_line(tmp_path, capsys, text, needles):
    path = write_manifest(tmp_path, text)
    code, _, err = run_cli(capsys, "aot", "build", "--manifest", path, "--dry-run")
    one_line_error(code, err, path, *needles)


def test_missing_manifest_lists_the_packaged_ones(capsys):
    code, _, err = run_cli(capsys, "aot", "build", "--manifest", "no_such_manifest", "--dry-run")
    one_line_error(code, err, "no manifest 'no_such_manifest'", "default")


@pytest.mark.parametrize("content", ["[1, 2]", "{\"kernels\": 5}", "not json"])
def test_malformed_bundle_manifest_is_one_line(tmp_path, capsys, content):
    (tmp_path / "manifest.json").write_text(content)
    for argv in (["aot", "verify", str(tmp_path)], ["aot", "merge", str(tmp_path / "out"), str(tmp_path)]):
        code, _, err = run_cli(capsys, *argv)
        one_line_error(code, err, str(tmp_path / "manifest.json"), "rebuild the bundle")


# -- bad variables and flags ----------------------------------------------------------------------
def test_bad_log_level_warns_and_the_package_still_imports():
    done = run_python("import mslk_dsl.ops, mslk_dsl.jit, logging; print(len(logging.getLogger('mslk_dsl').handlers))",
                      env={"MSLK_DSL_LOG_LEVEL": "LOUD", "PYTHONWARNINGS": "default"})
    assert done.stdout.strip() == "0"  # no handler added: the program's logging set-up decides
    assert "MSLK_DSL_LOG_LEVEL='LOUD' is not a log level" in done.stderr and "WARNING" in done.stderr


def test_bad_aot_workers_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("MSLK_DSL_AOT_WORKERS", "abc")
    with pytest.raises(env.SettingError, match="MSLK_DSL_AOT_WORKERS='abc': expected a positive whole number"):
        env.aot_workers()
    monkeypatch.setattr(aot_manifest, "expand", lambda *a, **k: [])  # nothing to compile: fail on the setting
    code, _, err = run_cli(capsys, "aot", "build", "--manifest", MANIFEST, "--out", "unused")
    one_line_error(code, err, "MSLK_DSL_AOT_WORKERS='abc'", "unset it")


@pytest.mark.parametrize("value", ["3", "0/2", "3/2", "a/b", "1/0"])
def test_bad_shard_names_the_flag_and_the_form(capsys, value):
    code, _, err = run_cli(capsys, "aot", "build", "--manifest", MANIFEST, "--shard", value, "--dry-run")
    one_line_error(code, err, f"--shard {value!r}", "I/N")


def test_bad_max_size_names_the_flag_and_the_form(capsys, cache_dir):
    code, _, err = run_cli(capsys, "cache", "prune", "--max-size", "banana")
    one_line_error(code, err, "--max-size 'banana'", "500M")
    code, _, err = run_cli(capsys, "cache", "prune", "--max-size", "-5")
    one_line_error(code, err, "--max-size '-5'")


def test_cache_max_size_variable_is_checked_too(monkeypatch):
    monkeypatch.setenv("MSLK_DSL_CACHE_MAX_SIZE", "lots")
    with pytest.raises(env.SettingError, match="MSLK_DSL_CACHE_MAX_SIZE 'lots'"):
        env.cache_max_size()


def test_missing_aot_path_entry_warns_once_and_is_described(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope")
    monkeypatch.setenv("MSLK_DSL_AOT_PATH", os.pathsep.join([str(tmp_path), missing]))
    env._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert env.aot_paths() == [str(tmp_path), missing]
    assert [str(w.message) for w in caught if missing in str(w.message)] == [
        f"mslk-dsl: MSLK_DSL_AOT_PATH names {missing}, which is not a directory; "
        "fix the path or remove it from MSLK_DSL_AOT_PATH"]
    described = env.describe_aot_path()
    assert f"{missing} (does not exist)" in described and f"{tmp_path}," in described
    env._warned.clear()


def test_cache_ls_into_a_closed_pipe_ends_quietly():
    # `mslk-dsl ... | head`: the reader is gone before the command writes.
    proc = subprocess.Popen([sys.executable, "-m", "mslk_dsl.cli", "templates"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_project_errors_are_one_line(capsys, monkeypatch):
    from mslk_dsl.errors import CompileError

    def fail(args):
        raise CompileError("the compiler failed on x.py:3")
    monkeypatch.setattr(cli, "cmd_targets", fail)
    code, _, err = run_cli(capsys, "targets")
    one_line_error(code, err, "the compiler failed on x.py:3")


# -- typos ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needles", [
    (["--op", "scale_copyy"], ["unknown op 'scale_copyy'", "scale_copy", "silu_mul"]),
    (["--target", "sm91"], ["unknown target 'sm91'", "sm90a", "gfx942"]),
    (["--config", "threads129"], ["unknown config 'threads129'", "threads128"]),
    (["--sig", "fator=2"], ["unknown signature part 'fator'", "factor"]),
    (["--sig", "factor=7"], ["unknown value of signature part factor 7", "2"]),
])
def test_unknown_names_on_the_command_line_are_errors(capsys, argv, needles):
    code, out, err = run_cli(capsys, "aot", "build", "--manifest", MANIFEST, "--dry-run", *argv)
    one_line_error(code, err, *needles)
    assert "jobs" not in out


@pytest.mark.parametrize("argv,needles", [
    # each name exists, but together they select no kernel
    (["--op", "silu_mul", "--target", "sm80"], ["no template of silu_mul targets sm80", "sm90a"]),
    (["--op", "silu_mul", "--target", "gfx942", "--config", "chunks4_rows_per_block1_threads256_vec8"],
     ["matches no valid kernel", "mslk-dsl templates"]),
    # hundreds of known configs: the nearest few, not all of them
    (["--config", "chunks4_rows_per_block1_threads256_vec9"],
     ["unknown config 'chunks4_rows_per_block1_threads256_vec9'", "nearest: ", "chunks4_rows_per_block1_threads256_vec8"]),
])
def test_names_that_select_nothing_are_errors_not_an_empty_build(capsys, argv, needles):
    code, out, err = run_cli(capsys, "aot", "build", "--dry-run", *argv)
    one_line_error(code, err, *needles)
    assert "jobs" not in out and len(err) < 600


@pytest.mark.parametrize("text,needles", [
    ('targets = ["sm90a"]\nkernels = []\n', ["the manifest lists no [[kernels]]"]),
    ('[[kernels]]\nop = "silu_mull"\n', ["op 'silu_mull' in the manifest matches no op", "silu_mul"]),
    ('targets = ["sm9a"]\n[[kernels]]\nop = "scale_copy"\n', ["unknown target 'sm9a'"]),
    ('targets = ["sm90a"]\n[[kernels]]\nop = "scale_copy"\nconfigs = ["threads12"]\n', ["unknown config 'threads12'"]),
    ('targets = ["sm90a"]\n[[kernels]]\nop = "scale_copy"\nsignatures = { factr = [2] }\n',
     ["unknown signature part 'factr'"]),
])
def test_unknown_names_in_a_manifest_are_errors(tmp_path, capsys, text, needles):
    code, _, err = run_cli(capsys, "aot", "build", "--manifest", write_manifest(tmp_path, text), "--dry-run")
    one_line_error(code, err, *needles)


def test_known_names_still_expand(capsys):
    code, out, _ = run_cli(capsys, "aot", "build", "--manifest", MANIFEST, "--dry-run", "--target", "sm90a",
                           "--config", "threads128", "--sig", "factor=2")
    assert code == 0 and out.strip().endswith("1 jobs")


def test_explain_refuses_unknown_names_and_exits_non_zero_on_a_miss(capsys, cache_dir):
    code, _, err = run_cli(capsys, "explain", "scale_copyy", "--target", "sm90a")
    one_line_error(code, err, "unknown op 'scale_copyy'")
    code, _, err = run_cli(capsys, "explain", "scale_copy", "--target", "sm91")
    one_line_error(code, err, "unknown target 'sm91'")
    code, _, err = run_cli(capsys, "explain", "scale_copy", "--target", "sm90a", "--sig", "fator=2")
    one_line_error(code, err, "unknown signature part(s) ['fator']")
    code, out, _ = run_cli(capsys, "explain", "scale_copy", "--target", "sm90a", "--sig", "factor=2")
    assert code == 1 and "MISS" in out and "MSLK_DSL_AOT_PATH" in out
    # an fp32 weight beside fp32 x is the plain signature: the flagged one is no call's
    code, _, err = run_cli(capsys, "explain", "rmsnorm", "--target", "sm90a", "--sig", "dtype=float32",
                           "--sig", "fp32_weight=True")
    one_line_error(code, err, "is no call's", "rmsnorm_cute")
    # parts not given come from a signature that agrees with the given ones: attention's v head
    # dim follows q's (192 -> 128, the first pair with q / k of 192), and a pair none has is refused
    code, out, _ = run_cli(capsys, "explain", "attention_fwd", "--target", "sm90a", "--sig", "head_dim=192")
    assert code == 1 and "head_dim_v not given: using 128" in out and "MISS" in out
    code, _, err = run_cli(capsys, "explain", "attention_fwd", "--target", "sm90a", "--sig", "head_dim=96",
                           "--sig", "head_dim_v=128")
    one_line_error(code, err, "is no call's", "attention_fwd_cute")


def test_templates_reports_configs_no_signature_can_use(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "tpl"
    folder.mkdir()
    (folder / "dead_config.py").write_text(textwrap.dedent("""\
        from mslk_dsl.template import Template
        TEMPLATE = Template(op="dead_config_op", backend="cute", targets=("sm90a",), signatures={"dtype": ("bf16",)},
                            space={"threads": (128, 256, 512)}, valid=lambda c, t, s: c["threads"] < 512,
                            heuristic=lambda t, s, p: {"threads": 128}, build=None)
        """))
    monkeypatch.setenv("MSLK_DSL_TEMPLATE_PATH", os.pathsep.join([os.environ["MSLK_DSL_TEMPLATE_PATH"], str(folder)]))
    registry.reload()
    try:
        code, out, _ = run_cli(capsys, "templates", "--op", "dead_config_op")
        assert code == 0 and "1 config(s) no target and signature can use: threads512" in out
        code, out, _ = run_cli(capsys, "templates", "--op", "dead_config_op", "--json")
        assert json.loads(out)[0]["unusable_configs"] == ["threads512"]
        code, _, err = run_cli(capsys, "templates", "--op", "dead_config_opp")
        one_line_error(code, err, "unknown op 'dead_config_opp'")
    finally:
        monkeypatch.undo()
        registry.reload()


def test_cache_dir_that_is_a_file_is_an_error_not_an_empty_cache(tmp_path, capsys, monkeypatch):
    path = tmp_path / "a-file"
    path.write_text("")
    monkeypatch.setenv("MSLK_DSL_CACHE_DIR", str(path))
    for argv in (["cache", "ls"], ["cache", "stats"], ["cache", "verify"]):
        code, _, err = run_cli(capsys, *argv)
        one_line_error(code, err, str(path), "MSLK_DSL_CACHE_DIR")


def test_tune_refuses_an_unknown_op(capsys):
    code, _, err = run_cli(capsys, "tune", "--op", "bf16_gemmm", "--shapes", "M=1,N=1,K=1")
    one_line_error(code, err, "unknown op 'bf16_gemmm'", "bf16_gemm")


@pytest.mark.parametrize("argv,needles", [
    (["explain", "silu_mul", "--target", "sm90a", "--problem", "M=1,K=banana"], ["whole numbers", "K='banana'"]),
    (["explain", "silu_mul", "--target", "sm90a", "--problem", "M=1,Q=3"], ["unknown size(s) ['Q']", "M, K"]),
    (["explain", "silu_mul", "--target", "sm90a", "--problem", "M=1,M=2"], ["['M'] given more than once"]),
    (["tune", "--op", "silu_mul", "--shapes", "M=banana"], ["whole numbers", "M='banana'"]),
    (["tune", "--op", "silu_mul", "--sig", "dtyp=bfloat16", "--shapes", "M=3,K=64"], ["unknown signature part(s) ['dtyp']"]),
    (["resources", "--op", "silu_mull"], ["unknown op 'silu_mull'", "silu_mul"]),
    (["resources", "--target", "sm99"], ["unknown target 'sm99'", "sm90a"]),
])
def test_bad_sizes_and_names_are_one_line_errors(capsys, cache_dir, argv, needles):
    code, out, err = run_cli(capsys, *argv)
    one_line_error(code, err, *needles)
    assert out == ""


def test_tune_without_a_gpu_says_so(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, _, err = run_cli(capsys, "tune", "--op", "silu_mul", "--shapes", "M=3,K=64")
    one_line_error(code, err, "there is none")
