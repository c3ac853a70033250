"""llmtrain: hybrid-parallel LLM pretraining on PaddlePaddle.

Importing the package first (every entry script and module does, before Paddle) installs one warning filter:
Paddle 3.3.1 looks for ccache when it is imported (`paddle.utils.cpp_extension`, for compiling custom C++ ops,
which llmtrain never does) and warns "No ccache found" in every process that lacks it. Only that warning of that
module is ignored.
"""
import warnings

warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning,
                        module=r"paddle\.utils\.cpp_extension")
