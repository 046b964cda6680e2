"""Where a run's wall time went: attempts read from the event log, split per cause,
drawn as a timeline."""
