"""The FP8 accuracy study (docs/fp8-accuracy.md): are adapters trained over an FP8 base (``model.base_fp8``) as good
as bf16-trained ones, scored in bf16, at the study v2's lengths? ``protocol`` holds the rules (pure), ``run`` the
Ray Tune calls, ``report`` the gaps and the decision, ``cli`` the command
(``python -m raytrain_scu.studies.ablation.fp8 experiments/ablation-v2.yaml --out docs/fp8-accuracy``)."""
