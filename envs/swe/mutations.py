"""Planted bugs: small AST mutations of the kind people make (off-by-one, flipped comparison, wrong
operator, and/or swapped). Every mutable spot of a function is a numbered site; `mutate` applies one."""

from __future__ import annotations

import ast
import copy
from typing import Callable, Optional

_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
            ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Div, ast.Div: ast.FloorDiv,
               ast.Mod: ast.FloorDiv}
_BOOLEAN = {ast.And: ast.Or, ast.Or: ast.And}
_SYMBOL = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
           ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Div: "/",
           ast.Mod: "%", ast.And: "and", ast.Or: "or"}


class _Sites(ast.NodeTransformer):
    """Walks a tree numbering mutable spots; rewrites the one numbered `target` (if any)."""

    def __init__(self, target: Optional[int] = None):
        self.target = target
        self.count = 0
        self.description: Optional[str] = None

    def _site(self, node: ast.AST, rewrite: Callable[[], ast.AST], description: str) -> ast.AST:
        index, self.count = self.count, self.count + 1
        if index != self.target:
            return node
        self.description = f"line {node.lineno}: {description}"
        return ast.copy_location(rewrite(), node)

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        op = type(node.ops[0])
        if len(node.ops) != 1 or op not in _COMPARE:
            return node
        return self._site(node, lambda: ast.Compare(node.left, [_COMPARE[op]()], node.comparators),
                          f"{_SYMBOL[op]} -> {_SYMBOL[_COMPARE[op]]}")

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        op = type(node.op)
        if op not in _ARITHMETIC:
            return node
        return self._site(node, lambda: ast.BinOp(node.left, _ARITHMETIC[op](), node.right),
                          f"{_SYMBOL[op]} -> {_SYMBOL[_ARITHMETIC[op]]}")

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        self.generic_visit(node)
        op = type(node.op)
        if op not in _ARITHMETIC:
            return node
        return self._site(node, lambda: ast.AugAssign(node.target, _ARITHMETIC[op](), node.value),
                          f"{_SYMBOL[op]}= -> {_SYMBOL[_ARITHMETIC[op]]}=")

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        op = type(node.op)
        return self._site(node, lambda: ast.BoolOp(_BOOLEAN[op](), node.values), f"{_SYMBOL[op]} -> "
                                                                                   f"{_SYMBOL[_BOOLEAN[op]]}")

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if type(node.value) is not int:
            return node
        return self._site(node, lambda: ast.Constant(node.value + 1), f"{node.value} -> {node.value + 1}")


def count_sites(source: str) -> int:
    sites = _Sites()
    sites.visit(ast.parse(source))
    return sites.count


def mutate(source: str, site: int) -> tuple[str, str]:
    """(mutated source, what changed) for mutation site number `site` of source."""
    sites = _Sites(site)
    tree = sites.visit(copy.deepcopy(ast.parse(source)))
    if sites.description is None:
        raise IndexError(f"no mutation site {site} (there are {sites.count})")
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n", sites.description
