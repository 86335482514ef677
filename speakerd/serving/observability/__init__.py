"""Prometheus metrics of the service and the bounded HTTP endpoint that serves them."""
