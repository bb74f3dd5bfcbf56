"""Pearson correlation coefficient, as the Hub's `evaluate-metric/pearsonr`, shipped here so the recipes need no network
(GLUE STS-B's metrics)."""

import datasets
import evaluate
from scipy.stats import pearsonr as _pearsonr

_DESCRIPTION = "Pearson correlation coefficient between predictions and references."
_CITATION = ""
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): predicted scores.
    references (`list` of `float`): ground-truth scores.
Returns:
    pearsonr (`float`): the coefficient, in [-1, 1].
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Pearsonr(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float32"), "references": datasets.Value("float32")}
            ),
            reference_urls=["https://docs.scipy.org/doc/scipy/reference/generated/scipy.stats.pearsonr.html"],
        )

    def _compute(self, predictions, references):
        return {"pearsonr": float(_pearsonr(references, predictions)[0])}
