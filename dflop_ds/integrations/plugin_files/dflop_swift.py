"""The file ``swift sft --external_plugins "$(dflop-ds plugin-path swift)" --callbacks dflop`` imports:
it registers DFLOP's ``dflop`` callback in ms-swift (:mod:`dflop_ds.integrations.swift`)."""

from dflop_ds.integrations.swift import register

register()
