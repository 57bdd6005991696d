"""The tuner (``python -m edgetvm.tune``): measured knob search per kernel, guided by an
XGBoost cost model, recorded in a crash-safe tuning log that ``edgetvm.build --log``
replays. See :mod:`edgetvm.tune.log`, :mod:`edgetvm.tune.tasks`,
:mod:`edgetvm.tune.cost_model`, :mod:`edgetvm.tune.tuner`."""
