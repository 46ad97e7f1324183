"""The job's config: the composed job's schemas (pretrain_config), each field's one-line
description (field_docs) and --help's rendering of the composed config (config_help).
Nothing is imported here.
"""
