"""Matthews correlation, as the Hub's `evaluate-metric/matthews_correlation` (GLUE's CoLA metric),
shipped here so the recipes need no network."""

import datasets
import evaluate
from sklearn.metrics import matthews_corrcoef

_DESCRIPTION = "Matthews correlation coefficient: a balanced measure of binary and multiclass quality."
_CITATION = ""
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    sample_weight (`list` of `float`, *optional*): per-sample weights.
Returns:
    matthews_correlation (`float`), in [-1, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int32"), "references": datasets.Value("int32")}
            ),
            reference_urls=[
                "https://scikit-learn.org/stable/modules/generated/sklearn.metrics.matthews_corrcoef.html"
            ],
        )

    def _compute(self, predictions, references, sample_weight=None):
        return {
            "matthews_correlation": float(
                matthews_corrcoef(references, predictions, sample_weight=sample_weight)
            )
        }
