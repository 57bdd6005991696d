"""The deployable artifact: ``python -m edgetvm.build`` then ``python -m edgetvm.run
model.npu``, checked against onnxruntime; deterministic bytes; refusals of damaged files."""
import json
import os
import pathlib
import stat
import zipfile

import numpy as np
import pytest
from reference_loop import greedy_loop, onnxruntime_model

from edgetvm.build.cli import build
from edgetvm.build.cli import main as build_main
from edgetvm.run import main as run_main
from edgetvm.runner import LocalRunner
from edgetvm.runtime.artifact import ArtifactError, load_artifact
from edgetvm.runtime.model import ModelRunner

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
LLAMA = str(DATA / "llama_tiny_with_past.onnx")
OPTIONS = dict(buckets=(8, 16), max_tokens=64, progress=False)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "llama.npu"
    build(LLAMA, str(path), **OPTIONS, jobs=2)      # programs compiled in two processes
    return path


def test_artifact_runs_token_exact_and_loads_nothing_but_its_own_files(artifact):
    art = load_artifact(str(artifact))
    m = art.manifest
    # prefill per bucket, the largest bucket at every KV capacity (chunks of a long
    # prompt), decode per capacity
    assert sorted(art.keys) == sorted([("prefill", 8, 1), ("prefill", 16, 1),
                                       ("prefill", 16, 2), ("prefill", 16, 4)] +
                                      [("decode", 1, p) for p in (1, 2, 4)])
    assert m["onnx"]["sha256"] and m["target"]["name"] == "edge-npu-16mb"
    assert m["model"] == {"layers": 2, "kv_heads": 2, "head_dim": 16, "page_tokens": 16,
                          "max_tokens": 64, "vocab": 512}
    # weights live in the pack, once: programs share them by name
    with zipfile.ZipFile(artifact) as z:
        assert set(z.namelist()) == {"manifest.json", "manifest.sha256", "weights.bin"} | \
            {e["file"] for e in m["programs"]}
    run, names, kv = onnxruntime_model(LLAMA)
    want, calls = greedy_loop(run, names, kv, [5, 17, 42, 7], 10)
    runner = ModelRunner(art.program, art.keys, art.info, LocalRunner("edge-npu-16mb"))
    recs = runner.generate([5, 17, 42, 7], 10)
    assert [r.token for r in recs] == want
    for rec, call in zip(recs, calls):
        ref = call["logits"][0, -1]
        assert np.abs(rec.logits - ref).max() <= 0.01 + 0.01 * np.abs(ref).max()
    assert {r.program for r in recs} == {"prefill_8x1p", "decode_1x1p"}


def test_building_twice_gives_identical_bytes(artifact, tmp_path):
    """Serially or in three processes (each lowering the kernels it meets, sending the
    weights it has not sent): the bytes of the two-process build, manifest included."""
    for jobs in (1, 3):
        again = tmp_path / f"again{jobs}.npu"
        build(LLAMA, str(again), **OPTIONS, jobs=jobs)
        assert again.read_bytes() == artifact.read_bytes(), jobs


def test_an_error_in_a_worker_is_the_builds_error_and_writes_nothing(
        artifact, tmp_path, monkeypatch):
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.build.graph import BuildError
    link = ModelCompiler.link

    def failing(self, graph, groups, name, **kw):   # inherited by the forked workers
        if name == "prefill_16x2p":
            raise BuildError("no kernel for op 7 of prefill_16x2p")
        return link(self, graph, groups, name, **kw)
    monkeypatch.setattr(ModelCompiler, "link", failing)
    out = tmp_path / "x.npu"
    out.write_bytes(b"an earlier build")
    with pytest.raises(BuildError, match="op 7 of prefill_16x2p"):
        build(LLAMA, str(out), **OPTIONS, jobs=2)
    assert out.read_bytes() == b"an earlier build"
    assert not list(tmp_path.glob(".model-*"))


def test_a_worker_that_dies_is_a_clear_error_not_a_hang(artifact, tmp_path, monkeypatch):
    import os

    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.build.graph import BuildError
    link = ModelCompiler.link

    def dying(self, graph, groups, name, **kw):     # as if the kernel killed it
        if name == "decode_1x2p":
            os._exit(9)
        return link(self, graph, groups, name, **kw)
    monkeypatch.setattr(ModelCompiler, "link", dying)
    with pytest.raises(BuildError, match="build worker died.*-j 1"):
        build(LLAMA, str(tmp_path / "x.npu"), **OPTIONS, jobs=2)
    assert not list(tmp_path.iterdir())


def _rewrite(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, edit(info.filename, zin.read(info.filename)))


def test_a_damaged_or_altered_artifact_is_refused(artifact, tmp_path):
    bad = tmp_path / "bad.npu"

    def flip_weight(name, data):
        if name != "weights.bin":
            return data
        b = bytearray(data)
        b[len(b) // 2] ^= 0xFF
        return bytes(b)
    _rewrite(artifact, bad, flip_weight)
    with pytest.raises(ArtifactError, match="weights.bin does not match its SHA-256"):
        load_artifact(str(bad))

    def newer(name, data):
        if name != "manifest.json":
            return data
        m = json.loads(data)
        m["format_version"] = 99
        return json.dumps(m).encode()
    _rewrite(artifact, bad, newer)
    with pytest.raises(ArtifactError, match="format version 99"):
        load_artifact(str(bad))

    def alter_program(name, data):
        return data.replace(b'"Launch"', b'"Launch" ', 1) if name.startswith("programs/") \
            else data
    _rewrite(artifact, bad, alter_program)
    art = load_artifact(str(bad))
    with pytest.raises(ArtifactError, match="does not match its SHA-256"):
        art.program(art.keys[0])
    bad.write_bytes(b"not a zip")
    with pytest.raises(ArtifactError, match="not a model.npu"):
        load_artifact(str(bad))

    # an edited manifest (here the strategy it reports, then the model's KV capacity)
    for field, value in (("strategy", "mega"), ("model", None)):
        def edit(name, data, field=field, value=value):
            if name != "manifest.json":
                return data
            m = json.loads(data)
            if value is None:
                m["model"]["max_tokens"] *= 2
            else:
                m[field] = value
            return json.dumps(m, indent=1, sort_keys=True).encode()
        _rewrite(artifact, bad, edit)
        with pytest.raises(ArtifactError, match="manifest.json does not match its SHA-256"):
            load_artifact(str(bad))
    # a manifest that is JSON but not an object
    _rewrite(artifact, bad, lambda name, data: b"[1]" if name == "manifest.json" else data)
    with pytest.raises(ArtifactError, match="manifest.json is not an object"):
        load_artifact(str(bad))
    # damaged deflate data or a bad CRC: the zip's own errors, named
    raw = bytearray(artifact.read_bytes())
    with zipfile.ZipFile(artifact) as z:
        infos = {i.filename: i for i in z.infolist()}
    for name in ("manifest.json", "weights.bin"):
        i = infos[name]
        b = bytearray(raw)
        start = i.header_offset + 30 + len(i.filename.encode()) + len(i.extra)
        b[start + i.compress_size // 2] ^= 0xFF
        bad.write_bytes(bytes(b))
        with pytest.raises(ArtifactError, match=f"{name} is damaged"):
            load_artifact(str(bad))


def test_build_and_run_commands(artifact, tmp_path, capsys):
    out = tmp_path / "cli.npu"
    assert build_main([LLAMA, "-o", str(out), "--buckets", "8", "--max-tokens", "32",
                       "-q"]) == 0
    assert "wrote" in capsys.readouterr().out
    trace = tmp_path / "step.json"
    assert run_main([str(out), "--prompt-ids", "5,17,42,7", "--max-new-tokens", "3",
                     "--check-onnx", LLAMA, "--trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert "check-onnx: ids identical" in text and "decode_1x" not in text
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"DmaLoad", "Mma"} <= names and any(n.startswith("Launch") for n in names)
    # an artifact that does not exist, a prompt past the KV capacity: clear errors
    assert run_main([str(tmp_path / "missing.npu"), "--prompt-ids", "1"]) == 2
    assert "not a model.npu" in capsys.readouterr().err
    assert run_main([str(out), "--prompt-ids", ",".join(["1"] * 40)]) == 2
    assert "KV cache holds 32 tokens" in capsys.readouterr().err
    # a prompt longer than the largest bucket runs as chunks of it
    assert run_main([str(out), "--prompt-ids", ",".join(map(str, range(1, 21))),
                     "--max-new-tokens", "2", "--check-onnx", LLAMA]) == 0
    assert "ids identical" in capsys.readouterr().out


def test_run_keys_its_build_cache_by_the_compiler_and_rebuilds_what_does_not_load(
        tmp_path, monkeypatch, capsys):
    import edgetvm.build.fingerprint as fingerprint

    monkeypatch.setenv("EDGETVM_CACHE", str(tmp_path))
    args = [LLAMA, "--prompt-ids", "5,17", "--max-new-tokens", "1", "--max-tokens", "32", "-q"]
    assert run_main(args) == 0
    assert "building" in capsys.readouterr().out
    [cached] = list(tmp_path.glob("*.npu"))
    assert run_main(args) == 0 and "using the build" in capsys.readouterr().out
    # a torn file (or one another edgetvm wrote under this name) is rebuilt, not an error
    cached.write_bytes(cached.read_bytes()[:100])
    assert run_main(args) == 0
    assert "does not load" in capsys.readouterr().out
    load_artifact(str(cached))
    # other compiler sources: another cache entry, never this one
    monkeypatch.setattr(fingerprint, "compiler_fingerprint", lambda: "0" * 16)
    assert run_main(args) == 0
    assert "building" in capsys.readouterr().out and len(list(tmp_path.glob("*.npu"))) == 2


def test_run_builds_an_onnx_file_with_the_buckets_asked_for(tmp_path, monkeypatch, capsys):
    """``run model.onnx --buckets``: the cached build has those prefill buckets (and is
    another cache entry than the default's); a model.npu refuses the option."""
    monkeypatch.setenv("EDGETVM_CACHE", str(tmp_path))
    args = [LLAMA, "--prompt-ids", "5,17,42,7,9,11,13,15,17,19", "--max-new-tokens", "2",
            "--max-tokens", "32", "-q", "--check-onnx"]
    assert run_main(args + ["--buckets", "4,16"]) == 0
    assert "ids identical" in capsys.readouterr().out
    [cached] = list(tmp_path.glob("*.npu"))
    assert sorted({r for p, r, _ in load_artifact(str(cached)).keys if p == "prefill"}) == [4, 16]
    assert run_main(args) == 0
    assert len(list(tmp_path.glob("*.npu"))) == 2
    with pytest.raises(SystemExit):
        run_main([str(cached), "--prompt-ids", "5", "--buckets", "4"])
    assert "a model.npu has its own" in capsys.readouterr().err
    # the build's other choices too (they were ignored without a word)
    for opt in (["--quantize", "32"], ["--max-tokens", "64"]):
        with pytest.raises(SystemExit):
            run_main([str(cached), "--prompt-ids", "5", *opt])
        assert f"{opt[0]} choose(s) how an ONNX file is built" in capsys.readouterr().err


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys,
                                                                     monkeypatch):
    """build -o, run --trace and tune --report-json into a missing directory or onto a
    directory: a clear error before anything compiles, runs or is measured (it was a
    traceback once the work was done)."""
    from edgetvm.tune.cli import main as tune_main

    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr("edgetvm.build.cli.build", no_work)
    monkeypatch.setattr("edgetvm.run.cached_build", no_work)
    monkeypatch.setattr("edgetvm.tune.cli.tune", no_work)
    missing = tmp_path / "no" / "such"
    (tmp_path / "d").mkdir()
    for argv, flag, main, code in (
            ([LLAMA, "-o", str(missing / "m.npu")], "-o", build_main, 1),
            ([LLAMA, "-o", str(tmp_path / "d")], "-o", build_main, 1),
            ([LLAMA, "--prompt-ids", "1,2", "--trace", str(missing / "t.json")], "--trace",
             run_main, 2),
            ([LLAMA, "--trials", "2", "--log", str(tmp_path / "log"), "--report-json",
              str(missing / "r.json")], "--report-json", tune_main, 1)):
        assert main(argv) == code
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag} ") and ("no directory" in err or
                                                      "is a directory" in err), err
    # the model itself as the output: it would be overwritten by the zip
    model = tmp_path / "m.onnx"
    model.write_bytes(pathlib.Path(LLAMA).read_bytes())
    assert build_main([str(model), "-o", str(model)]) == 1
    assert "is the model being built" in capsys.readouterr().err
    assert model.read_bytes() == pathlib.Path(LLAMA).read_bytes()
    # ... nor is a trace or a report written over a file the command reads: the model,
    # an artifact, the --check-onnx model, the tuning log
    log = tmp_path / "tl"
    log.mkdir()
    (log / "records.jsonl").write_bytes(b"")
    art = tmp_path / "a.npu"
    art.write_bytes(b"not yet")
    run = ["--prompt-ids", "1,2", "--max-new-tokens", "1", "--trace"]
    for argv, main, code, said in (
            ([str(model), *run, str(model)], run_main, 2, "--trace %s is the model being run"),
            ([str(art), *run, str(art)], run_main, 2, "--trace %s is the model being run"),
            ([LLAMA, "--check-onnx", str(model), *run, str(model)], run_main, 2,
             "--trace %s is the --check-onnx model"),
            ([LLAMA, "--log", str(log), *run, str(log / "records.jsonl")], run_main, 2,
             "--trace %s is the tuning log"),
            ([str(model), "--trials", "1", "--log", str(log), "--report-json", str(model)],
             tune_main, 1, "--report-json %s is the model being tuned"),
            (["--trials", "1", "--log", str(log), "--report-json",
              str(log / "records.jsonl")], tune_main, 1, "--report-json %s is the tuning log")):
        before = pathlib.Path(argv[-1]).read_bytes()
        assert main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.startswith("error: " + said % argv[-1]), err
        assert pathlib.Path(argv[-1]).read_bytes() == before
    # the same file by another name: a relative path, a symbolic link
    link = tmp_path / "link.jsonl"
    link.symlink_to(log / "records.jsonl")
    monkeypatch.chdir(tmp_path)
    assert build_main([str(model), "-o", "./m.onnx"]) == 1
    assert "-o ./m.onnx is the model being built" in capsys.readouterr().err
    assert run_main([LLAMA, "--log", str(log), *run, str(link)]) == 2
    assert f"--trace {link} is the tuning log" in capsys.readouterr().err
    assert model.read_bytes() == pathlib.Path(LLAMA).read_bytes() and link.is_symlink()
    # a --log whose parent is missing (a typo) is not created
    with pytest.raises(SystemExit) as e:
        tune_main(["--trials", "1", "--log", str(missing / "log")])
    assert e.value.code == 2
    assert "no directory" in capsys.readouterr().err and not missing.exists()
    # an empty path; a device or pipe (replaced by the zip, as root even /dev/full)
    assert build_main([LLAMA, "-o", ""]) == 1
    assert "-o: an empty path" in capsys.readouterr().err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert build_main([LLAMA, "-o", str(fifo)]) == 1
    assert "exists and is not a regular file" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    # a directory that takes no new file, whatever its permission bits say to root
    if os.path.isdir("/proc/self"):
        assert build_main([LLAMA, "-o", "/proc/self/m.npu"]) == 1
        assert "-o /proc/self/m.npu: not writable" in capsys.readouterr().err
    # a build cache that is a file
    monkeypatch.undo()
    monkeypatch.setenv("EDGETVM_CACHE", str(model))
    assert run_main([LLAMA, "--prompt-ids", "1,2"]) == 2
    assert "is not a directory edgetvm can create" in capsys.readouterr().err


def _with_external_data(src, dst_dir):
    """``src`` saved in ``dst_dir`` as m.onnx with its weights in m.onnx.data."""
    import onnx
    path = dst_dir / "m.onnx"
    onnx.save(onnx.load(src), str(path), save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    return path


def _scale_largest_weight(path, scale):
    """Scale, in place in its external data file, the largest float tensor of ``path``
    (the .onnx file is not touched)."""
    import onnx
    model = onnx.load(str(path), load_external_data=False)
    init = max((t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT),
               key=lambda t: np.prod(t.dims))
    info = {e.key: e.value for e in init.external_data}
    data = path.parent / info["location"]
    raw = bytearray(data.read_bytes())
    lo, n = int(info.get("offset", 0)), int(info["length"])
    raw[lo:lo + n] = (np.frombuffer(bytes(raw[lo:lo + n]), np.float32) * scale).tobytes()
    data.write_bytes(bytes(raw))


def test_a_model_with_external_data_is_its_graph_and_its_weights(tmp_path, monkeypatch,
                                                                 capsys):
    """A model whose weights are in an external data file: its identity (the build cache's
    key, the artifact's and the tuning log's model hash) covers that file, so new weights
    beside the same .onnx are never served by the old build (``run`` reused it: a wrong
    answer, caught only by --check-onnx); -o onto the weights is refused, not overwritten;
    a missing weights file is a one-line error."""
    from edgetvm.build.fingerprint import file_sha256, model_sha256
    assert model_sha256(LLAMA) == file_sha256(LLAMA)       # self-contained: the file's hash
    path = _with_external_data(LLAMA, tmp_path)
    data = tmp_path / "m.onnx.data"
    first = model_sha256(str(path))
    assert first != file_sha256(str(path))
    monkeypatch.setenv("EDGETVM_CACHE", str(tmp_path / "cache"))
    args = [str(path), "--prompt-ids", "5,17", "--max-new-tokens", "2", "--max-tokens", "32",
            "-q", "--check-onnx"]
    assert run_main(args) == 0 and "building" in capsys.readouterr().out
    graph = path.read_bytes()
    _scale_largest_weight(path, 1.5)                      # new weights, the same graph
    assert path.read_bytes() == graph and model_sha256(str(path)) != first
    assert run_main(args) == 0
    out = capsys.readouterr().out
    assert "building" in out and "ids identical" in out
    assert len(list((tmp_path / "cache").glob("*.npu"))) == 2
    before = data.read_bytes()
    assert build_main([str(path), "-o", str(data)]) == 1
    assert "is the external data (weights) of the model being built" in capsys.readouterr().err
    assert data.read_bytes() == before
    data.unlink()
    assert build_main([str(path), "-o", str(tmp_path / "m.npu")]) == 1
    err = capsys.readouterr().err
    assert "cannot read the model's external data" in err and "Traceback" not in err
    assert run_main(args[:-1]) == 2             # no --check-onnx: hashed for the cache
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "m.onnx.data" in err and "Traceback" not in err


def test_a_kv_capacity_past_what_a_build_takes_is_refused_at_once(tmp_path, capsys):
    """--max-tokens 100000 ran the build's mask check out of memory after 2 minutes."""
    from edgetvm.build.compiler import MAX_KV_TOKENS, ModelCompiler
    from edgetvm.build.graph import BuildError

    for n in (str(MAX_KV_TOKENS + 1), "99999999999999999999"):
        with pytest.raises(SystemExit):
            build_main([LLAMA, "-o", str(tmp_path / "m.npu"), "--max-tokens", n])
        assert f"--max-tokens must be in 1..{MAX_KV_TOKENS}" in capsys.readouterr().err
    with pytest.raises(BuildError, match=f"caches of up to {MAX_KV_TOKENS} tokens"):
        ModelCompiler(LLAMA, max_tokens=MAX_KV_TOKENS + 1)


def test_refusals_name_the_option_that_would_serve(artifact, capsys):
    """No bucket fits the cache, a chunk over it, an artifact run with another --target or
    with chunks its prefill programs do not serve: each refused before any step, naming
    the option that fixes it."""
    from edgetvm.build.cli import prefill_rows
    from edgetvm.errors import EdgeTVMError

    assert prefill_rows((16, 32, 64), 40) == (16, 32)
    with pytest.raises(EdgeTVMError, match=r"--buckets 8 or --chunk 8, or a larger"):
        prefill_rows((16, 32), 15)
    with pytest.raises(EdgeTVMError, match=r"--chunk 2000 is over the KV cache of 1024 "
                                           r"tokens \(--chunk 1024"):
        prefill_rows((2000,), 1024, chunk=2000)
    assert run_main([str(artifact), "--prompt-ids", "5", "--target", "edge-npu-4mb"]) == 2
    assert "built for edge-npu-16mb, not edge-npu-4mb (--target)" in capsys.readouterr().err
    # chunks of 4 at 0, 4 and 8 run on the 8-row bucket; the one at 12 needs 16 rows, whose
    # programs append whole pages
    assert run_main([str(artifact), "--prompt-ids", ",".join(["5"] * 16), "--chunk", "4"]) == 2
    out = capsys.readouterr()
    assert "chunks of 4: a chunk at position 12" in out.err and "--chunk 4" in out.err
    assert "prefill" not in out.out.split("step ")[-1]          # no step ran


def test_a_model_is_hashed_once_while_its_files_stay_as_they_were(tmp_path, monkeypatch):
    """model_sha256 keeps a digest while the file's stat is unchanged and it was written
    long enough ago (a file written just now may change again within the clock's
    resolution with the same stat): hashed again after a change, and never served stale."""
    import shutil

    from edgetvm.build import fingerprint as fp
    path = tmp_path / "m.onnx"
    shutil.copy(LLAMA, path)
    calls = []
    real = fp._model_sha256
    monkeypatch.setattr(fp, "_model_sha256", lambda p: calls.append(p) or real(p))
    first = fp.model_sha256(str(path))
    fp.model_sha256(str(path))
    assert len(calls) == 2                     # just written: not kept
    monkeypatch.setattr(fp, "RACY_NS", 0)      # (as if written long ago)
    assert fp.model_sha256(str(path)) == first and fp.model_sha256(str(path)) == first
    assert len(calls) == 3                     # settled: hashed once more, then kept
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 1                              # the same size, then the same mtime again
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert fp.model_sha256(str(path)) != first and len(calls) == 4
    # a symbolic link pointed at another file is another model
    link, other = tmp_path / "link.onnx", tmp_path / "other.onnx"
    shutil.copy(LLAMA, other)
    link.symlink_to(path)
    assert fp.model_sha256(str(link)) == fp.model_sha256(str(path))
    link.unlink()
    link.symlink_to(other)
    assert fp.model_sha256(str(link)) == fp.file_sha256(str(other)) == fp.file_sha256(LLAMA)
