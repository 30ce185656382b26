"""Callbacks the configs in conf/callbacks/ refer to."""
