"""Row-reduction templates: RMSNorm, LayerNorm and softmax over the last axis.

Each op is a chain of vector instructions over a row tile (``workloads.rms_norm_te`` and
friends): a reduction needs whole rows, so the tile is ``tile_m`` rows x all columns, and
the chain is scheduled by the fusion-cluster machinery (``fused.schedule_cluster``: one op
is a cluster of one stage). Intermediates are fp32 in TCM; the weight/bias vectors are
loaded once per kernel. Knobs:

``tile_m``
    rows per tile (the edge tile is clipped);
``slots_x``
    TCM copies of the input tile (2 = the next row tile loads during this one's compute);
``slots_out``
    TCM copies of the output tile (2 = its store overlaps the next tile);
``dma_split``
    1 keeps loads off the store channel.
"""
from __future__ import annotations

from .fused import KNOBS_SINCE, schedule_cluster

#: knob names in sampling order (``search.knob_space``)
KNOBS = ("tile_m", "slots_x", "slots_out", "dma_split", "tcm_fresh", "list_schedule")


def schedule_row_norm(sch, *, tile_m=None, slots_x=None, slots_out=None, dma_split=None,
                      tcm_fresh=KNOBS_SINCE["tcm_fresh"],
                      list_schedule=KNOBS_SINCE["list_schedule"]):
    """Schedule ``workloads.rms_norm`` / ``layer_norm`` / ``softmax`` in place
    (``tcm_fresh``, ``list_schedule``: as ``fused.schedule_cluster``'s)."""
    return schedule_cluster(sch, tile_m=tile_m, slots_in={"x": slots_x}, slots_out=slots_out,
                            dma_split=dma_split, tcm_fresh=tcm_fresh,
                            list_schedule=list_schedule)


schedule_rms_norm = schedule_row_norm
schedule_layer_norm = schedule_row_norm
schedule_softmax = schedule_row_norm
