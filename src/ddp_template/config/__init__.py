"""Composing and checking a run's config, before any worker process starts: types and ranges
(schema), every value that depends on the machine (checks), the real objects built once and
dropped (trial_objects), the command line's plugins and keys (plugins) and the resolvers of
conf/. Where conf/ is, and a config as dotted keys: `ddp_template.project`."""
