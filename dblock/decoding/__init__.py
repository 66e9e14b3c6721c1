"""What every executor shares: the step rules (samplers), the block lifecycles (schedules), the request driver and
`generate`. Executors differ only in forward math; everything that turns logits into decisions lives here, and so
does `dblock compare-schedules` (`compare.py`, registered by `cli.py`): every schedule on the same requests."""
