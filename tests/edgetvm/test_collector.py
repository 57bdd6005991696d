"""edgetvm.collector: fewer garbage-collector passes inside, the caller's thresholds after."""
import gc

import pytest

from edgetvm.collector import THRESHOLDS, fewer_collections


def test_thresholds_apply_inside_and_come_back_after_an_error():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with pytest.raises(ValueError):
            with fewer_collections():
                assert gc.get_threshold() == THRESHOLDS
                raise ValueError("a failed build")
        assert gc.get_threshold() == (700, 10, 10)

        @fewer_collections()
        def build():
            return gc.get_threshold()

        assert build() == THRESHOLDS
        assert gc.get_threshold() == (700, 10, 10)
        assert gc.isenabled()
    finally:
        gc.set_threshold(*before)
