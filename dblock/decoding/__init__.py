"""What every executor shares: the step rules (samplers), the block lifecycles (schedules), the request driver and
`generate`. Executors differ only in forward math; everything that turns logits into decisions lives here, and so
does the pure math of decision margins (`margins.py`: how far logits may move before a decision changes) and of
the decision radius (`radius.py`). Below every executor room: it reaches executors only through the Forward
protocol (dblock/forward.py), and imports no command-line module."""
