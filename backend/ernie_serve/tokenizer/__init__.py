"""SentencePiece tokenizer with ERNIE special tokens, HF-style chat templates, streaming detokenizer."""
from .chat_template import ChatTemplateError
from .detokenizer import IncrementalDetokenizer
from .tokenizer import ErnieTokenizer

__all__ = ["ChatTemplateError", "ErnieTokenizer", "IncrementalDetokenizer"]
