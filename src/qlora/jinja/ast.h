// The parsed template: statements and expressions, each with the line and column it came from so
// that evaluation errors name them.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "qlora/jinja/lexer.h"
#include "qlora/jinja/value.h"

namespace qlora::jinja {

enum class ExprKind {
  kLiteral, kName, kList, kTuple, kDict, kAttr, kItem, kSlice, kCall, kFilter, kTest,
  kNeg, kPos, kNot, kBinary, kCompare, kAnd, kOr, kCond
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;
using Kwargs = std::vector<std::pair<std::string, ExprPtr>>;

struct Expr {
  ExprKind kind;
  int line = 1, col = 1;
  Value literal;                 // kLiteral
  std::string name;              // kName; kAttr: attribute; kFilter/kTest: name; kBinary: operator
  // kList/kTuple: items; kDict: key, value, key, value...; kAttr/kItem: object (and key);
  // kSlice: object, start, stop, step (null when absent); kCall: callee, positional args;
  // kFilter/kTest: the operand (null in a {% filter %} block), positional args;
  // kNeg/kPos/kNot: operand; kBinary/kAnd/kOr: left, right; kCompare: operands;
  // kCond: then, condition, else (null when absent: undefined).
  std::vector<ExprPtr> children;
  Kwargs kwargs;                 // kCall, kFilter, kTest
  std::vector<std::string> ops;  // kCompare: ==, !=, <, <=, >, >=, in, notin between operands
  bool negated = false;          // kTest: `is not`
};

enum class StmtKind {
  kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kCallBlock, kFilterBlock, kBreak, kContinue, kGeneration
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Param {
  std::string name;
  ExprPtr default_value;  // null: none given
};

struct Stmt {
  StmtKind kind;
  int line = 1, col = 1;
  std::string text;                  // kText
  ExprPtr expr;                      // kOutput/kSet: the value; kFor: the iterable; kCallBlock: the call;
                                     // kFilterBlock: the filter chain (innermost operand null)
  std::vector<std::pair<ExprPtr, Body>> branches;  // kIf: (condition or null for else, body)
  std::vector<std::string> targets;  // kFor loop variables; kSet/kSetBlock names
  std::string attribute;             // kSet/kSetBlock on `ns.attr`: targets[0] is ns
  ExprPtr condition;                 // kFor: the `if` filter
  Body body, else_body;              // kFor else; kMacro/kCallBlock/kFilterBlock/kSetBlock/kGeneration body
  std::string name;                  // kMacro
  std::vector<Param> params;         // kMacro; kCallBlock: caller's parameters
};

struct Program {
  Body body;
  std::string origin;
};

// Throws TemplateError naming origin, line and column.
Program parse_program(const std::vector<Token>& tokens, const std::string& origin);

}  // namespace qlora::jinja
