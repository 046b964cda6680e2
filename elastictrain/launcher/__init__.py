"""The launcher process: ``elastictrain run`` around torchrun, its agent and the
agent's failure policy."""
