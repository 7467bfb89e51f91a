// The parsed template: expressions and statements, each with the line and column it starts at
// (errors name them). parse.cpp builds it, template.cpp runs it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "qlora/jinja/value.h"

namespace qlora::jinja {

struct Where {
  int line = 1, column = 1;
};

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum class Op {
    kLiteral,    // value
    kName,       // name
    kList,       // args (also tuples)
    kDict,       // args: key, value, key, value, ...
    kAttr,       // args[0].name
    kIndex,      // args[0][args[1]]
    kSlice,      // args[0][args[1]:args[2]:args[3]] (null parts absent)
    kCall,       // args[0](args[1..]) with kwarg_names for the trailing keyword ones
    kFilter,     // name applied to args[0] with args[1..]
    kTest,       // args[0] is [not] name(args[1..]); negate
    kUnary,      // name ("not", "-", "+") args[0]
    kBinary,     // name (operator) args[0], args[1]
    kCondition,  // args[1] if args[0] else args[2] (absent: undefined)
  };
  Op op = Op::kLiteral;
  Where where;
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::string> kwarg_names;  // kCall/kFilter/kTest: names of the last args
  bool negate = false;
};

struct Stmt;
using StmtPtr = std::shared_ptr<const Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  enum class Kind {
    kText,        // text
    kOutput,      // {{ expr }}
    kIf,          // branches: (cond, body) ..., else_body
    kFor,         // targets in expr [if filter]: body [else else_body]
    kSet,         // targets (or attr target) = expr, or block set: body
    kMacro,       // name(params = defaults): body
    kBreak,
    kContinue,
    kGeneration,  // {% generation %}: body, its output span recorded
    kFilterBlock, // {% filter name(args) %}: body's output through expr (a kFilter, args[0] unused)
  };
  Kind kind = Kind::kText;
  Where where;
  std::string text;
  ExprPtr expr, filter;
  std::vector<std::string> targets;
  std::string attr;  // kSet: targets[0].attr = expr
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body, else_body;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // per param; null when none
};

// Throws TemplateError (template.h) naming origin, line and column.
Body parse_template(const std::string& source, const std::string& origin);

}  // namespace qlora::jinja
