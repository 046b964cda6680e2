"""Views of a run built from its event log: the live terminal view and ``status``.

``tail`` follows the JSON-lines event files, ``model`` reduces events into a
:class:`~elastictrain.view.model.RunState`, ``live`` draws it on a terminal and
``status`` reports it for a run started elsewhere.
"""
