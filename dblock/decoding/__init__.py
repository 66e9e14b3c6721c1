"""What every executor shares: the step rules (samplers), the block lifecycles (schedules), the request driver and
`generate`. Executors differ only in forward math; everything that turns logits into decisions lives here."""
