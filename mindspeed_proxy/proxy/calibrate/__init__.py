"""The calibration forward: the original model run on calibration tokens."""
