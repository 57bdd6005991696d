"""The .npuprog format: exact round trips, and clear refusals of anything else."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from edgetvm.errors import ProgramFormatError
from edgetvm.target import program_format as pf
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import (Affine, DmaLoad, DmaStore, DramRef, EventSignal, EventWait,
                                HostOp, Launch, Mma, TcmRef, Vector)
from edgetvm.target.spec import EMULATOR_MODEL_VERSION


def rich_program(spec):
    """Every command type and operand form: strided refs, affine offsets, when, attrs."""
    rng = np.random.default_rng(7)
    b = ProgramBuilder("rich", spec)
    pos, n = b.param("pos"), b.param("n")
    b.tensor("x", (8, 64), "float16", "input")
    w = rng.integers(0, 256, (64, 32)).astype(np.uint8)
    b.tensor("w", w.shape, "uint8", "const", w)
    b.tensor("s", (64, 2), "float16", "const", rng.random((64, 2)) * 0.1)
    b.tensor("kv", (16, 64), "float32", "state")
    b.tensor("y", (8, 64), "float32", "output")
    b.tensor("tok", (8,), "int32", "output")
    tx, tw, ts = b.tcm((8, 64), "float16"), b.tcm((64, 32), "uint8"), b.tcm((64, 2), "float16")
    acc, t2 = b.tcm((8, 64), "float32"), b.tcm((8, 64), "float32")
    ev = [b.event() for _ in range(8)]
    b.emit(DmaLoad(dst=tx, src=b.dram("x"), valid_rows=n, signal=(ev[0],)))
    b.emit(DmaLoad(dst=tw, src=b.dram("w"), channel=1, signal=(ev[1],)))
    b.emit(DmaLoad(dst=ts, src=b.dram("s"), channel=1, signal=(ev[2],)))
    b.emit(Mma(out=acc, a=tx, b=tw, scales=ts, group_size=32, transpose_b=True,
               wait=(ev[0], ev[1], ev[2]), signal=(ev[3],)))
    b.emit(EventWait(on="vector", wait=(ev[3],)))
    b.emit(Vector(op="mask", dst=t2, srcs=(acc,), limit=pos + 3, causal_offset=Affine(2)))
    b.emit(Vector(op="mul", dst=t2, srcs=(t2,), imm=0.5, when=pos - 1))
    b.emit(Vector(op="add", dst=t2, srcs=(t2,), imm=1.0, when=(pos - 1, n - 3)))
    b.emit(EventSignal(on="vector", signal=(ev[4], ev[7])))
    b.emit(DmaStore(dst=DramRef("kv", (1, 64), 64, pos * 64), src=t2.rows(0, 1),
                    wait=(ev[4],), signal=(ev[5],)))
    b.emit(DmaStore(dst=b.dram("y"), src=t2, channel=1, wait=(ev[7],), signal=(ev[6],)))
    b.emit(HostOp(fn="argmax", inputs=("y",), outputs=("tok",), attrs=(("axis", -1),),
                  flops=512, wait=(ev[6],)))
    b.emit(Launch(name="next"))
    return b.build(note="round trip", bucket=[1, 2])


def run_twice(spec, program):
    x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float16)
    emu = Emulator(spec)
    return [emu.run(program, {"x": x}, {"pos": p, "n": 6}) for p in (0, 2)]


def assert_same_runs(ra, rb):
    for a, b in zip(ra, rb):
        assert a.counters == b.counters
        assert a.outputs.keys() == b.outputs.keys()
        for k in a.outputs:
            np.testing.assert_array_equal(a.outputs[k], b.outputs[k])


def test_round_trip_in_memory(spec):
    p = rich_program(spec)
    q = pf.loads(pf.dumps(p))
    from edgetvm.target.isa import COMMAND_TYPES
    assert {type(c).__name__ for c in p.commands} == set(COMMAND_TYPES)
    assert q.commands == p.commands
    assert q.params == p.params == ("pos", "n")
    assert (q.name, q.tcm_bytes, q.spec_hash, q.metadata) == \
        (p.name, p.tcm_bytes, spec.hash(), {"note": "round trip", "bucket": [1, 2]})
    # the file records the emulator model it was written under
    assert q.emulator_model == p.emulator_model == EMULATOR_MODEL_VERSION
    for name, t in p.tensors.items():
        u = q.tensors[name]
        assert (u.shape, u.dtype, u.kind) == (t.shape, t.dtype, t.kind)
        if t.data is not None:
            np.testing.assert_array_equal(u.data, t.data)
        else:
            assert u.data is None
    assert pf.dumps(q) == pf.dumps(p)              # deterministic bytes
    ra, rb = run_twice(spec, p), run_twice(spec, q)
    # pos 0: the two predicated commands are off (one predicate, a tuple of two); pos 2: on
    assert ra[1].counters.commands_skipped == 0 and ra[0].counters.commands_skipped == 2
    two = [c.when for c in q.commands if isinstance(c.when, tuple)]
    assert two == [(Affine.param("pos", 1, -1), Affine.param("n", 1, -3))]
    assert_same_runs(ra, rb)


def test_round_trip_through_a_file(spec, tmp_path, double_buffered):
    p, inputs, ref = double_buffered(spec, 64, 4)
    path = tmp_path / "gemm.npuprog"
    pf.save(p, str(path))
    q = pf.load(str(path))
    emu = Emulator(spec)
    a, b = emu.run(p, inputs), emu.run(q, inputs)
    assert a.counters == b.counters
    np.testing.assert_array_equal(a.outputs["y"], b.outputs["y"])
    np.testing.assert_allclose(b.outputs["y"], ref, rtol=1e-4, atol=1e-3)


@pytest.fixture
def blob(spec):
    return pf.dumps(rich_program(spec))


def test_other_version_is_refused(blob):
    other = blob[:8] + struct.pack("<I", pf.FORMAT_VERSION + 1) + blob[12:]
    with pytest.raises(ProgramFormatError,
                       match=f"old.npuprog: program format version {pf.FORMAT_VERSION + 1}; "
                             f"this edgetvm reads version {pf.FORMAT_VERSION}. Recompile"):
        pf.loads(other, source="old.npuprog")


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file_is_refused(blob, keep):
    with pytest.raises(ProgramFormatError, match="checksum mismatch: the file is truncated or "
                                                 "damaged"):
        pf.loads(blob[:int(len(blob) * keep)])


def test_truncated_to_a_few_bytes_is_refused(blob):
    with pytest.raises(ProgramFormatError, match="not an edgetvm NPU program"):
        pf.loads(blob[:20])


@pytest.mark.parametrize("where", [0.3, 0.7, -1])
def test_flipped_byte_is_refused(blob, where):
    i = int(len(blob) * where) if where > 0 else len(blob) - 1
    bad = bytearray(blob)
    bad[i] ^= 0x10
    with pytest.raises(ProgramFormatError, match="checksum mismatch"):
        pf.loads(bytes(bad))


def test_random_bytes_are_refused(tmp_path):
    path = tmp_path / "noise.npuprog"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ProgramFormatError, match=f"{path}: not an edgetvm NPU program"):
        pf.load(str(path))


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ProgramFormatError, match="cannot read program"):
        pf.load(str(tmp_path / "nope.npuprog"))


def test_valid_checksum_over_malformed_json_is_refused(blob):
    # a well-formed container whose header is not a program
    import hashlib
    js = b'{"name": "x"}'
    body = pf._HEAD.pack(pf.MAGIC, pf.FORMAT_VERSION, len(js)) + js + struct.pack("<Q", 0)
    with pytest.raises(ProgramFormatError, match="malformed program"):
        pf.loads(body + hashlib.sha256(body).digest())


def _v1(program, v2: bytes) -> bytes:
    """``program`` as format version 1 wrote it: each command a JSON object of its fields,
    operands inline (written here from the format's description, not by edgetvm)."""
    import dataclasses
    import hashlib
    import json

    def enc(v):
        if isinstance(v, TcmRef):
            return {"tcm": [v.offset, v.shape[0], v.shape[1], v.dtype, v.row_stride]}
        if isinstance(v, DramRef):
            return {"dram": [v.tensor, v.shape[0], v.shape[1], v.row_stride, enc(v.offset)]}
        if isinstance(v, Affine):
            return {"affine": [v.const, [list(t) for t in v.terms]]}
        if isinstance(v, tuple):
            return [enc(x) for x in v]
        return v

    _, _, jlen = pf._HEAD.unpack_from(v2)
    js = json.loads(v2[pf._HEAD.size:pf._HEAD.size + jlen])
    rest = v2[pf._HEAD.size + jlen:-32]                          # blob length + blob
    js.pop("classes"), js.pop("operands")
    js["commands"] = [{"command": type(c).__name__,
                       **{f.name: enc(getattr(c, f.name)) for f in dataclasses.fields(c)}}
                      for c in program.commands]
    body = json.dumps(js).encode()
    body = pf._HEAD.pack(pf.MAGIC, 1, len(body)) + body + rest
    return body + hashlib.sha256(body).digest()


def test_a_version_1_file_still_loads(spec):
    p = rich_program(spec)
    q = pf.loads(_v1(p, pf.dumps(p)))
    assert q.commands == p.commands and q.params == p.params
    assert pf.loads(pf.dumps(q)).commands == p.commands          # and saves as version 2
