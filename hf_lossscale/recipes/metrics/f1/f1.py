"""F1, as the Hub's `evaluate-metric/f1`, shipped here so the recipes need no network."""

import datasets
import evaluate
from sklearn.metrics import f1_score

_DESCRIPTION = "F1: the harmonic mean of precision and recall."
_CITATION = ""
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    labels (`list` of `int`, *optional*): the labels to include when `average != "binary"`.
    pos_label (`int`, defaults to 1): the positive class when `average="binary"`.
    average (`str`, defaults to `"binary"`): `"binary"`, `"micro"`, `"macro"`, `"weighted"` or `None`.
    sample_weight (`list` of `float`, *optional*): per-sample weights.
Returns:
    f1 (`float`, or an array of floats when `average=None`).
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=[
                "https://scikit-learn.org/stable/modules/generated/sklearn.metrics.f1_score.html"
            ],
        )

    def _compute(
        self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None
    ):
        score = f1_score(
            references,
            predictions,
            labels=labels,
            pos_label=pos_label,
            average=average,
            sample_weight=sample_weight,
        )
        return {"f1": float(score) if getattr(score, "size", 1) == 1 else score}
