"""What the tuner's records were measured as, rebuilt independently of the tuner's run."""
from edgetvm.build.compiler import ModelCompiler
from edgetvm.target.spec import load_spec
from edgetvm.tune.log import log_context
from edgetvm.tune.log import Replay
from edgetvm.tune.tasks import extract_partition_tasks, extract_tasks


def logged_tasks(onnx, log_dir, keys, profile=None, **compiler_kw):
    """(compiler, workload -> task) of a tuning log's records over the phase programs
    ``keys``: the partition tasks of the runs as a first round measures them (default
    tiles), and the kernel tasks of the partition with the log's best cuts (what that
    round's tile stage tunes)."""
    ctx = log_context(onnx, load_spec("edge-npu-16mb"), profile, None)
    rp = Replay(log_dir, ctx)
    mc = ModelCompiler(onnx, profile=profile, cuts_for=rp.cuts_for, **compiler_kw)
    tasks = extract_tasks(mc, keys) + extract_partition_tasks(mc, keys)
    return mc, {t.workload: t for t in tasks}
