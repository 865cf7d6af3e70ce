"""The operator's own autoscaler: per-stage replica counts from the pipeline's own load, graph-aware.

``decide`` is the pure decision (tested on signal traces); ``signals`` reads the runtimes' metrics from
the pods; ``loop`` runs both for every OmniModel with a stage on ``provider: operator`` and writes
replicas through the Deployments' scale subresource.
"""
