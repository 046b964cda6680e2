"""Launches of one run, told apart by their launch ids (``runlog.events`` makes them:
UTC start time first, so they sort by start). A program that starts one job on several
agents at once (the multi-node demo) gives node ``i`` the id ``<launch>-n<i>``: each
agent logs its own, and they all belong to one launch of the job. Pure functions:
the view's model reads them without the event log's machinery."""

from __future__ import annotations


def node_launch_id(launch: str, node: int) -> str:
    """The launch id of node ``node`` of a job that one program starts on several agents
    at once (the multi-node demo): each agent's own, all of them ``launch``'s."""
    return f"{launch}-n{node}"


def in_launch(event_launch: object, launch: str) -> bool:
    """Whether an event of launch ``event_launch`` belongs to ``launch`` (or one of its
    nodes' launches)."""
    return isinstance(event_launch, str) and job_launch(event_launch) == launch


def job_launch(event_launch: str) -> str:
    """The launch an event's launch id belongs to (a node's launch: its job's)."""
    base, sep, node = event_launch.rpartition("-n")
    return base if sep and node.isdigit() else event_launch
