"""Small real-world model families written in PyTorch, for tests/test_real_models.py.

Each entry of MODELS builds a module whose forward returns its scalar loss, and example inputs for it. The
sizes are tiny (exports and builds must stay fast on 2 cores) but the structure is the family's: residual
adds, depthwise convolutions, skip concatenations, tied embeddings, rotary attention and so on.
Every parameter is perturbed away from its initial value, so that no two parameters are equal (ones and
zeros are common initial values) and each value identifies its parameter after an optimized export.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- CNNs ---------------------------------------------------------------------------------------------------

class PreActBlock(nn.Module):
    """Pre-activation basic block (ResNet v2): BN-ReLU-conv-BN-ReLU-conv plus the shortcut (a strided 1x1
    conv of the activated input where the shape changes, else the input itself)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.down = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if stride != 1 or cin != cout else None

    def forward(self, x):
        a = F.relu(self.bn1(x))
        h = self.conv2(F.relu(self.bn2(self.conv1(a))))
        return h + (x if self.down is None else self.down(a))


class ResNet(nn.Module):
    """Stem conv, two pre-activation blocks (the second strided), BN-ReLU, global average pool, linear
    classifier. Each block's first BN follows a residual add (or the stem, whose output the shortcut uses
    too), so an optimizing exporter cannot fold it into a conv; the second follows a conv and can be folded."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layer1 = PreActBlock(8, 8, 1)
        self.layer2 = PreActBlock(8, 16, 2)
        self.bn = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x, labels):
        h = F.relu(self.bn(self.layer2(self.layer1(self.stem(x)))))
        return F.cross_entropy(self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1)), labels)


class InvertedResidual(nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project (each with BN; ReLU6 between), residual."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 2):
        super().__init__()
        hidden = cin * expand
        self.expand = nn.Sequential(nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden,
                                                 bias=False), nn.BatchNorm2d(hidden), nn.ReLU6())
        self.project = nn.Sequential(nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        h = self.project(self.depthwise(self.expand(x)))
        return x + h if self.residual else h


class MobileNet(nn.Module):
    """Stem, a depthwise-separable conv (depthwise 3x3 + pointwise 1x1, hard-swish), two inverted residuals."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.Hardswish())
        self.separable = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8),
                                       nn.Hardswish(), nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12))
        self.block1 = InvertedResidual(12, 12, 1)
        self.block2 = InvertedResidual(12, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x, labels):
        h = self.block2(self.block1(self.separable(self.stem(x))))
        return F.cross_entropy(self.fc(h.mean((2, 3))), labels)


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1),
                         nn.ReLU())


class UNet(nn.Module):
    """Two levels down (max pool), one bottleneck, two up (ConvTranspose stride 2, concat with the skip);
    per-pixel cross-entropy over the classes."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.down1 = _double_conv(1, 4)
        self.down2 = _double_conv(4, 8)
        self.bottom = _double_conv(8, 16)
        self.up2 = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.dec2 = _double_conv(16, 8)
        self.up1 = nn.ConvTranspose2d(8, 4, 2, stride=2)
        self.dec1 = _double_conv(8, 4)
        self.head = nn.Conv2d(4, classes, 1)

    def forward(self, x, labels):
        s1 = self.down1(x)
        s2 = self.down2(F.max_pool2d(s1, 2))
        h = self.bottom(F.max_pool2d(s2, 2))
        h = self.dec2(torch.cat([self.up2(h), s2], dim=1))
        h = self.dec1(torch.cat([self.up1(h), s1], dim=1))
        return F.cross_entropy(self.head(h), labels)


class Conv1dNet(nn.Module):
    """1-D convs with GroupNorm and SiLU, a residual, a strided conv, mean over time, linear classifier."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 8, 5, padding=2)
        self.gn1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv1d(8, 8, 3, padding=1)
        self.gn2 = nn.GroupNorm(4, 8)
        self.conv3 = nn.Conv1d(8, 12, 3, stride=2, padding=1)
        self.gn3 = nn.GroupNorm(3, 12)
        self.fc = nn.Linear(12, classes)

    def forward(self, x, labels):
        h = F.silu(self.gn1(self.conv1(x)))
        h = h + F.silu(self.gn2(self.conv2(h)))
        h = F.silu(self.gn3(self.conv3(h)))
        return F.cross_entropy(self.fc(h.mean(-1)), labels)


# -- transformers -------------------------------------------------------------------------------------------

VOCAB, SEQ = 100, 8


class GPT2LM(nn.Module):
    """transformers' GPT2LMHeadModel (lm_head tied to the token embedding); loss: its LM loss with labels."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            attn_implementation="eager")
        self.lm = GPT2LMHeadModel(config)

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


class BertClassifier(nn.Module):
    """transformers' BertModel (with its attention mask and token types) and a linear head on the pooled
    [CLS] output; cross-entropy."""

    def __init__(self, classes: int = 3):
        super().__init__()
        from transformers import BertConfig, BertModel
        config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32, type_vocab_size=2,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                            attn_implementation="eager")
        self.bert = BertModel(config)
        self.head = nn.Linear(32, classes)

    def forward(self, input_ids, attention_mask, token_type_ids, labels):
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return F.cross_entropy(self.head(out.pooler_output), labels)


class LlamaLM(nn.Module):
    """transformers' LlamaModel (RMSNorm, rotary embeddings, SiLU-gated MLP, causal mask, grouped-query
    attention) and an untied linear LM head; next-token cross-entropy."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaModel
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             attn_implementation="eager", bos_token_id=0, eos_token_id=0, pad_token_id=0)
        self.llama = LlamaModel(config)
        self.head = nn.Linear(32, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        h = self.llama(input_ids=input_ids, use_cache=False).last_hidden_state
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class ViTBlock(nn.Module):
    """Pre-LN encoder block: x + MHA(LN(x)), then x + MLP(LN(x)) with exact GELU."""

    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Patch embedding (a strided Conv), a class token, learned position embeddings, two encoder blocks,
    final LayerNorm and a linear head on the class token; cross-entropy."""

    def __init__(self, image: int = 8, patch: int = 4, d: int = 16, classes: int = 5):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, d))
        self.blocks = nn.Sequential(ViTBlock(d, 2, 32), ViTBlock(d, 2, 32))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, labels):
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        h = self.ln(self.blocks(h))
        return F.cross_entropy(self.head(h[:, 0]), labels)


class LSTMTagger(nn.Module):
    """Embedding, a one-layer bidirectional nn.LSTM, a linear tag head per token; cross-entropy."""

    def __init__(self, tags: int = 5):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 12)
        self.lstm = nn.LSTM(12, 16, batch_first=True, bidirectional=True)
        self.head = nn.Linear(32, tags)

    def forward(self, tokens, tags):
        h, _ = self.lstm(self.emb(tokens))
        return F.cross_entropy(self.head(h).flatten(0, 1), tags.flatten())


# -- the table ------------------------------------------------------------------------------------------------

@dataclass
class Spec:
    make: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator], tuple]


def _images(shape, classes):
    return lambda g: (torch.randn(*shape, generator=g), torch.randint(0, classes, (shape[0],), generator=g))


def _tokens(batch=2, tags=VOCAB):
    return lambda g: (torch.randint(0, VOCAB, (batch, SEQ), generator=g),
                      torch.randint(0, tags, (batch, SEQ), generator=g))


def _bert_inputs(g):
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    mask = torch.ones(2, SEQ, dtype=torch.int64)
    mask[1, SEQ - 3:] = 0  # padding at the end of the second sequence
    types = torch.zeros(2, SEQ, dtype=torch.int64)
    types[:, SEQ // 2:] = 1
    return ids, mask, types, torch.randint(0, 3, (2,), generator=g)


def _unet_inputs(g):
    return torch.randn(2, 1, 8, 8, generator=g), torch.randint(0, 3, (2, 8, 8), generator=g)


MODELS: dict[str, Spec] = {
    "resnet": Spec(ResNet, _images((2, 3, 8, 8), 5)),
    "mobilenet": Spec(MobileNet, _images((2, 3, 8, 8), 5)),
    "unet": Spec(UNet, _unet_inputs),
    "conv1d_groupnorm": Spec(Conv1dNet, _images((2, 3, 16), 4)),
    "gpt2": Spec(GPT2LM, _tokens()),
    "bert": Spec(BertClassifier, _bert_inputs),
    "llama": Spec(LlamaLM, _tokens()),
    "vit": Spec(ViT, _images((2, 3, 8, 8), 5)),
    "lstm_tagger": Spec(LSTMTagger, _tokens(tags=5)),
}


def make(name: str) -> tuple[nn.Module, tuple]:
    """The model in eval mode with perturbed parameters and BatchNorm statistics, and its example inputs."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.make()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):  # non-trivial running statistics: eval BN is not the identity
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
    return model.eval(), spec.inputs(torch.Generator().manual_seed(2))
