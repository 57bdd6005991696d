"""The KV cache as explicit, persistent NPU state.

Every layer owns two DRAM ``state`` tensors on the device, ``L<n>.K_cache`` and
``L<n>.V_cache``, in the paged, head-grouped layout of ``tir_schedules/kv_cache.py``
(pages of ``page_tokens`` tokens). They live on the emulated device across calls: a step
appends only its new tokens' K/V (the append kernel's DRAM writes do not grow with the
past), and attention reads the pages through a page table (runtime parameters), so one
static program serves every length of its bucket:

* prefill / chunked prefill: one program per **length bucket** (the chunk is padded to
  the bucket; the kernels take ``pos``, ``valid_len`` and ``n_new`` at run time);
* decode: one program per **KV-capacity bucket** (pages rounded up to a power of two).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgetvm.errors import EdgeTVMError
from edgetvm.tir_schedules.kv_cache import PAGE_TOKENS, KVCacheLayout


@dataclass
class KVState:
    """Page allocation of one sequence over ``layers`` paged caches."""

    layers: int
    kv_heads: int
    head_dim: int
    max_tokens: int = 2048
    page_tokens: int = PAGE_TOKENS
    length: int = 0                                   # tokens in the cache
    page_table: list = field(default_factory=list)
    layer_len: dict = field(default_factory=dict)     # layer -> tokens on the device
    #: the order in which free pages are handed out (default ascending); any permutation
    #: of the pool is valid, as after other sequences freed pages out of order
    page_pool: list | None = None

    def __post_init__(self):
        pool = list(range(self.num_pages)) if self.page_pool is None else list(self.page_pool)
        if sorted(pool) != list(range(self.num_pages)):
            raise EdgeTVMError(f"page_pool must be a permutation of the {self.num_pages} "
                               f"cache pages")
        self.page_pool = pool

    @property
    def num_pages(self) -> int:
        return -(-self.max_tokens // self.page_tokens)

    @property
    def page_room(self) -> int:
        """Tokens the cache's pages hold: a step's padded rows may fill the last page."""
        return self.num_pages * self.page_tokens

    @property
    def layout(self) -> KVCacheLayout:
        return KVCacheLayout(self.kv_heads, self.head_dim, self.num_pages, self.page_tokens)

    def names(self, layer: int) -> dict:
        return {"K_cache": f"L{layer}.K_cache", "V_cache": f"L{layer}.V_cache"}

    def reset(self) -> None:
        self.length = 0
        self.page_table = []
        self.layer_len = {}

    def reserve(self, pos: int, tokens: int) -> None:
        """Make sure pages exist for tokens ``[pos, pos + tokens)`` (a step's padded rows
        too: they land in the cache's pages past the valid length, and are never read)."""
        end = pos + tokens
        if end > self.page_room:
            raise EdgeTVMError(f"the KV cache holds {self.max_tokens} tokens; this step "
                               f"writes {end} (raise max_tokens)")
        while len(self.page_table) * self.page_tokens < end:
            # the sequence's next page: the next free page of the pool
            self.page_table.append(self.page_pool[len(self.page_table)])


def capacity_bucket(pages: int) -> int:
    """Decode programs exist for power-of-two page counts."""
    b = 1
    while b < pages:
        b *= 2
    return b
