"""Helpers the tests share: training runs under ``spotrun run``, S3 and Ceph RGW servers, a fault
proxy, crash and mutation campaigns, memory probes, checkpoint file paths."""
