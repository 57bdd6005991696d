"""Elementwise templates: SiLU(gate) * up, GELU, the residual add, and RoPE.

The op's instructions (``workloads.silu_mul_te`` etc.) run per ``tile_m x tile_n`` tile
with every input tile DMA'd into TCM and the result stored from TCM; they are scheduled
by ``fused.schedule_cluster`` (one op = a cluster of one stage). RoPE rotates within a
head, so its tile is ``tile_m`` rows x all heads, one rope instruction per head. Knobs:

``tile_m, tile_n``
    tile rows / columns (any size; edge tiles are clipped; RoPE has no ``tile_n``);
``slots_<input>``
    TCM copies of each streamed input tile (2 = double buffering);
``slots_out``
    TCM copies of the output tile;
``dma_split``
    1 keeps loads off the store channel.
"""
from __future__ import annotations

from .fused import KNOBS_SINCE, schedule_cluster

#: knob names in sampling order: ``fused.knob_names(func)`` (one ``slots_<input>`` per input),
#: e.g. these for ``workloads.silu_mul`` and ``workloads.rope``
SILU_MUL_KNOBS = ("tile_m", "tile_n", "slots_g", "slots_u", "slots_out", "dma_split",
                  "tcm_fresh", "list_schedule")
ROPE_KNOBS = ("tile_m", "slots_x", "slots_cos", "slots_sin", "slots_out", "dma_split",
              "tcm_fresh", "list_schedule")


def schedule_elementwise(sch, *, tile_m=None, tile_n=None, slots_in=None, slots_out=None,
                         dma_split=None, tcm_fresh=KNOBS_SINCE["tcm_fresh"],
                         list_schedule=KNOBS_SINCE["list_schedule"]):
    """Schedule ``workloads.silu_mul`` / ``gelu`` / ``residual_add`` in place.

    ``slots_in``: one value for every input or a dict input name -> value;
    ``tcm_fresh``, ``list_schedule``: as ``fused.schedule_cluster``'s."""
    return schedule_cluster(sch, tile_m=tile_m, tile_n=tile_n, slots_in=slots_in,
                            slots_out=slots_out, dma_split=dma_split, tcm_fresh=tcm_fresh,
                            list_schedule=list_schedule)


def schedule_rope(sch, *, tile_m=None, slots_x=None, slots_cs=None, slots_out=None,
                  dma_split=None, tcm_fresh=KNOBS_SINCE["tcm_fresh"],
                  list_schedule=KNOBS_SINCE["list_schedule"]):
    """Schedule ``workloads.rope`` in place (``slots_cs``: the cos/sin tiles)."""
    return schedule_cluster(sch, tile_m=tile_m, slots_in={"x": slots_x, "cos": slots_cs,
                                                          "sin": slots_cs},
                            slots_out=slots_out, dma_split=dma_split, tcm_fresh=tcm_fresh,
                            list_schedule=list_schedule)
