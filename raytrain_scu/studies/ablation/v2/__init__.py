"""The GPU study v2 of docs/control.md §7: two plants, a three-way split of the plays, none / fixed λ / the spec's law
/ the logodds law, early stopping scored on the select plays, everything reported on the report plays.
``protocol`` holds its rules (pure), ``run`` the Ray Tune calls, ``stats`` the gaps and the decision, ``report``
the document, ``cli`` the command (``python -m raytrain_scu.ablation CONFIG --protocol v2``)."""
