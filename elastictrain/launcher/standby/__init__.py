"""Pre-imported standby workers: the agent starts workers by forking a process that has
already imported torch, instead of paying the imports in every new worker.

``server`` is the standby process itself, ``client`` the agent's handle on it,
``context`` the glue that makes torchrun's agent start its workers through it.
Why and what it saves: docs/recovery.md.
"""
