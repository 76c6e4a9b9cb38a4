"""The study v3 (docs/ablation-v3.md): does the logodds law at a target chosen without a λ grid match the best of a
9-point fixed-λ grid on plants that neither v2 nor the plant-model screen used? ``rule`` holds the grid-free target
and how it was derived from v2's P1 and P2, ``protocol`` the plants, arms and endpoints (pure), ``run`` the Ray Tune
calls, ``stats`` the endpoints and verdicts, ``report`` the document, ``cli`` the command
(``python -m raytrain_scu.studies.ablation.v3 experiments/ablation-v3.yaml --plants P5 --out docs/ablation-v3``)."""
