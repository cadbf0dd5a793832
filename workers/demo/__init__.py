"""The demo models `mlxq models pull-demo` puts in the store: fetched from wheels, or built and trained here.

Serving code never imports this package: it only makes store entries, which the worker then loads like any other.
"""
