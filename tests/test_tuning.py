"""The tuning DB: winners are keyed by GPU + toolchain, op, signature and shape bucket; stale
entries are ignored; the op layer prefers a stored winner over the heuristic."""
import json
import os

from mslk_dsl import registry, tuning
from mslk_dsl.ops.dispatch import KernelOp


def _write(cache_dir, context, config, problem):
    os.makedirs(cache_dir, exist_ok=True)
    key = tuning.entry_key("scale_copy", "sm90a", {"factor": 2}, problem)
    db = {"entries": {key: {"config": config, "ms": 0.1, "problem": problem, "context": context}}}
    with open(tuning.db_path(), "w") as f:
        json.dump(db, f)


def test_buckets_round_up_to_powers_of_two():
    assert tuning.bucket({"M": 1000, "N": 4096}) == "M1024,N4096"
    assert tuning.bucket({"M": 1}) == tuning.bucket({"M": 1}) == "M1"
    assert tuning.bucket({"M": 1025}) == "M2048"


def test_stored_winner_is_used_and_stale_ones_ignored(cache_dir):
    op = KernelOp("scale_copy", ("factor",), ("M",))
    heuristic = op.choose("sm90a", (2,), (1000,), None)[1]
    assert heuristic == {"threads": 256}
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}) is None

    _write(cache_dir, tuning.context(), {"threads": 128}, {"M": 1000})
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}) == {"threads": 128}
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 900}) == {"threads": 128}  # same bucket
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 5000}) is None
    assert op.choose("sm90a", (2,), (1000,), None)[1] == {"threads": 128}

    other_gpu = dict(tuning.context(), gpu="Some Other GPU")
    _write(cache_dir, other_gpu, {"threads": 128}, {"M": 1000})
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}) is None
    assert op.choose("sm90a", (2,), (1000,), None)[1] == heuristic


def test_explicit_config_wins(cache_dir):
    op = KernelOp("scale_copy", ("factor",), ("M",))
    assert op.choose("sm90a", (3,), (10,), {"threads": 128})[1] == {"threads": 128}


def test_autotuner_times_split_k_only_where_tiles_can_leave_sms_idle():
    from mslk_dsl import autotune

    (template,) = registry.get_templates(op="bf16_gemm", backend="cute")
    sig = {"dtype": "bfloat16"}

    def candidates(m):
        return autotune._candidates(template, "sm90a", sig, {"M": m, "N": 8192, "K": 8192})

    def split(m, tile_m):
        return [c for c in candidates(m) if "split_k" in c and c["tile_m"] == tile_m]

    assert split(1, 64) and split(autotune.SPLIT_K_MAX_M, 64)
    assert not split(autotune.SPLIT_K_MAX_M + 1, 64) and split(autotune.SPLIT_K_MAX_M + 1, 128)
    assert split(autotune.MID_SPLIT_K_MAX_M, 128)
    large = candidates(autotune.MID_SPLIT_K_MAX_M + 1)
    assert large and not any("split_k" in c for c in large)


def test_malformed_tuning_db_is_ignored_with_one_warning(cache_dir, recwarn):
    """A tuning.json holding a list (or anything but the expected object) must not break op
    calls: the heuristic serves, and one warning names the file."""
    op = KernelOp("scale_copy", ("factor",), ("M",))
    heuristic = op.choose("sm90a", (2,), (1000,), None)[1]
    os.makedirs(cache_dir, exist_ok=True)
    for content in ("[1, 2, 3]", "{\"entries\": [1]}", "{not json", "{\"entries\": {\"k\": 5}}"):
        tuning._load.cache_clear()
        recwarn.clear()
        with open(tuning.db_path(), "w") as f:
            f.write(content)
        for _ in range(3):
            assert op.choose("sm90a", (2,), (1000,), None)[1] == heuristic
            assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}) is None
        messages = [str(w.message) for w in recwarn if "tuning database" in str(w.message)]
        if content.startswith("{\"entries\": {"):
            assert messages == []  # a well-formed file with one bad record: that record is skipped
        else:
            assert len(messages) == 1 and tuning.db_path() in messages[0], (content, messages)
    tuning._load.cache_clear()


def test_storing_a_winner_replaces_a_malformed_db(cache_dir, recwarn):
    from mslk_dsl import autotune

    os.makedirs(cache_dir, exist_ok=True)
    with open(tuning.db_path(), "w") as f:
        f.write("[\"not\", \"a\", \"db\"]")
    autotune._store("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}, {"threads": 128}, 0.1)
    tuning._load.cache_clear()
    assert tuning.lookup("scale_copy", "sm90a", {"factor": 2}, {"M": 1000}) == {"threads": 128}
    assert any("tuning database" in str(w.message) for w in recwarn)
    tuning._load.cache_clear()


def test_the_tuner_times_calls_of_the_signature_it_stores(monkeypatch):
    """For every tunable op, the tuner's inputs (the declaration's example for the signature the
    tuner stores its winner under, ``autotune.tuning_signature``) make the op choose a kernel of
    exactly that signature. (The examples once left out scale_ub where the signature had it, so
    a winner timed on one kernel was stored for another.) The op runs on CPU tensors with a
    stand-in kernel; the signature it asks for is recorded."""
    from support import cpu_stands_in_for

    import mslk_dsl.ops as ops
    from mslk_dsl import autotune
    from mslk_dsl.ops import call, declaration

    cpu_stands_in_for("sm90a", monkeypatch)
    for op in autotune.tunable_ops():
        decl = declaration.get(op)
        template = registry.templates_for(op, "sm90a")[0]
        for sig in (None, {"has_scale_ub": True}, {"has_valid_count": True}):
            if sig and not set(sig) <= set(template.signatures):
                continue
            full_sig = autotune.tuning_signature(template, sig)
            asked = []
            monkeypatch.setattr(decl.kernels, "selection", lambda device, signature, problem, config=None: (
                asked.append(signature) or (lambda *args: None), {}))
            problem = dict(decl.small_problem)
            call.clear_python_plans()        # a plan of the previous signature's call would serve it
            getattr(ops, op)(*autotune.inputs_for(op, problem, full_sig, device="cpu"))
            want = tuple(full_sig[part] for part in decl.kernels.sig_fields)
            assert asked and asked[-1] == want, (op, sig, asked, want)
