"""Stages as the gateway reaches them (``handle``: the interface; ``local``: in process; ``remote``: over the
frame protocol) and the stage server that puts one engine behind that protocol (``server``)."""
