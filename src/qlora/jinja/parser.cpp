// Recursive descent over the lexer's tokens, with jinja2's grammar and operator precedence:
//   condexpr: or ('if' or ('else' condexpr)?)*    or: and ('or' and)*    and: not ('and' not)*
//   not: 'not' not | compare        compare: add (op add)*   (==, !=, <, <=, >, >=, in, not in)
//   add: concat (('+'|'-') concat)* concat: mul ('~' mul)*   mul: pow (('*'|'/'|'//'|'%') pow)*
//   pow: unary ('**' unary)*        unary: ('-'|'+') unary | primary postfix; then | filters, is tests
#include <set>

#include "qlora/jinja/ast.h"
#include "qlora/jinja/builtins.h"
#include "qlora/jinja/template.h"

namespace qlora::jinja {
namespace {

class Parser {
 public:
  Parser(const std::vector<Token>& tokens, const std::string& origin) : toks_(tokens), origin_(origin) {}

  Body parse_all() {
    std::string found;
    return parse_body({}, &found);
  }

 private:
  // --- statements ----------------------------------------------------------------------------
  // Parses until a block tag named in `ends` (consumed up to and including its name, which goes
  // to *found) or the end of the template when `ends` is empty.
  Body parse_body(const std::set<std::string>& ends, std::string* found) {
    Nest nest(*this, cur());
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::kEnd) {
        if (ends.empty()) return body;
        std::string expected;
        for (const std::string& end : ends) expected += (expected.empty() ? "'" : " or '") + end + "'";
        fail(t, "unexpected end of template, expected " + expected);
      }
      if (t.type == Tok::kText) {
        auto s = stmt(StmtKind::kText, t);
        s->text = t.text;
        body.push_back(std::move(s));
        ++pos_;
      } else if (t.type == Tok::kVarBegin) {
        ++pos_;
        auto s = stmt(StmtKind::kOutput, t);
        s->expr = parse_tuple(true);
        expect(Tok::kVarEnd, "'}}'");
        body.push_back(std::move(s));
      } else if (t.type == Tok::kBlockBegin) {
        const Token& keyword = toks_[pos_ + 1];
        if (keyword.type == Tok::kName && ends.count(keyword.text)) {
          pos_ += 2;
          *found = keyword.text;
          return body;
        }
        ++pos_;
        body.push_back(parse_statement());
      } else {
        fail(t, "unexpected token");
      }
    }
  }

  StmtPtr parse_statement() {
    const Token& t = cur();
    if (t.type != Tok::kName) fail(t, "tag name expected");
    ++pos_;
    const std::string& k = t.text;
    if (k == "for") return parse_for(t);
    if (k == "if") return parse_if(t);
    if (k == "set") return parse_set(t);
    if (k == "macro") return parse_macro(t);
    if (k == "call") return parse_call_block(t);
    if (k == "filter") return parse_filter_block(t);
    if (k == "generation") return parse_wrapped(t, StmtKind::kGeneration, "endgeneration");
    if (k == "break" || k == "continue") {
      if (loop_depth_ == 0) fail(t, "'" + k + "' outside of a loop");
      auto s = stmt(k == "break" ? StmtKind::kBreak : StmtKind::kContinue, t);
      expect(Tok::kBlockEnd, "'%}'");
      return s;
    }
    fail(t, "unknown tag '" + k + "' (outside the supported Jinja subset)");
  }

  StmtPtr parse_for(const Token& t) {
    auto s = stmt(StmtKind::kFor, t);
    bool paren = accept_op("(");
    do {
      s->targets.push_back(expect_name());
    } while (accept_op(","));
    if (paren) expect_op(")");
    if (!accept_name("in")) fail(cur(), "expected 'in'");
    s->expr = parse_tuple(false);
    if (accept_name("if")) s->condition = parse_expression(true);
    if (cur().type == Tok::kName && cur().text == "recursive") {
      fail(cur(), "recursive loops are outside the supported Jinja subset");
    }
    expect(Tok::kBlockEnd, "'%}'");
    ++loop_depth_;
    std::string found;
    s->body = parse_body({"endfor", "else"}, &found);
    --loop_depth_;
    if (found == "else") {
      expect(Tok::kBlockEnd, "'%}'");
      s->else_body = parse_body({"endfor"}, &found);
    }
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  StmtPtr parse_if(const Token& t) {
    auto s = stmt(StmtKind::kIf, t);
    ExprPtr condition = parse_tuple(false);
    while (true) {
      expect(Tok::kBlockEnd, "'%}'");
      std::string found;
      Body body = parse_body({"elif", "else", "endif"}, &found);
      s->branches.emplace_back(std::move(condition), std::move(body));
      if (found == "endif") break;
      if (found == "elif") {
        condition = parse_tuple(false);
      } else {
        expect(Tok::kBlockEnd, "'%}'");
        s->branches.emplace_back(nullptr, parse_body({"endif"}, &found));
        break;
      }
    }
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  StmtPtr parse_set(const Token& t) {
    auto s = stmt(StmtKind::kSet, t);
    s->targets.push_back(expect_name());
    if (accept_op(".")) {
      s->attribute = expect_name();
    } else {
      while (accept_op(",")) s->targets.push_back(expect_name());
    }
    if (accept_op("=")) {
      s->expr = parse_tuple(true);
      expect(Tok::kBlockEnd, "'%}'");
      return s;
    }
    if (s->targets.size() != 1) fail(cur(), "expected '='");
    if (cur().type != Tok::kBlockEnd) fail(cur(), "expected '=' or '%}' (filtered block set is outside the subset)");
    s->kind = StmtKind::kSetBlock;
    ++pos_;
    std::string found;
    s->body = parse_body({"endset"}, &found);
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  std::vector<Param> parse_params() {
    std::vector<Param> params;
    expect_op("(");
    while (!accept_op(")")) {
      if (!params.empty()) expect_op(",");
      if (accept_op(")")) break;
      Param p{expect_name(), nullptr};
      if (accept_op("=")) p.default_value = parse_expression(true);
      params.push_back(std::move(p));
    }
    return params;
  }

  StmtPtr parse_macro(const Token& t) {
    auto s = stmt(StmtKind::kMacro, t);
    s->name = expect_name();
    s->params = parse_params();
    expect(Tok::kBlockEnd, "'%}'");
    int saved = loop_depth_;
    loop_depth_ = 0;
    std::string found;
    s->body = parse_body({"endmacro"}, &found);
    loop_depth_ = saved;
    if (cur().type == Tok::kName) ++pos_;  // {% endmacro name %}
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  StmtPtr parse_call_block(const Token& t) {
    auto s = stmt(StmtKind::kCallBlock, t);
    if (cur().type == Tok::kOp && cur().text == "(") s->params = parse_params();
    s->expr = parse_expression(true);
    if (s->expr->kind != ExprKind::kCall) fail(t, "expected a call after 'call'");
    expect(Tok::kBlockEnd, "'%}'");
    int saved = loop_depth_;
    loop_depth_ = 0;
    std::string found;
    s->body = parse_body({"endcall"}, &found);
    loop_depth_ = saved;
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  StmtPtr parse_filter_block(const Token& t) {
    auto s = stmt(StmtKind::kFilterBlock, t);
    ExprPtr chain;
    do {
      chain = parse_filter(std::move(chain));
    } while (accept_op("|"));
    s->expr = std::move(chain);
    return parse_wrapped_body(std::move(s), "endfilter");
  }

  StmtPtr parse_wrapped(const Token& t, StmtKind kind, const std::string& end) {
    return parse_wrapped_body(stmt(kind, t), end);
  }

  StmtPtr parse_wrapped_body(StmtPtr s, const std::string& end) {
    expect(Tok::kBlockEnd, "'%}'");
    std::string found;
    s->body = parse_body({end}, &found);
    expect(Tok::kBlockEnd, "'%}'");
    return s;
  }

  // --- expressions ---------------------------------------------------------------------------
  // A comma-separated list is a tuple (`{{ a, b }}`, `{% set a, b = 1, 2 %}`).
  ExprPtr parse_tuple(bool with_condexpr) {
    const Token& t = cur();
    ExprPtr first = parse_expression(with_condexpr);
    if (!(cur().type == Tok::kOp && cur().text == ",")) return first;
    auto tuple = expr(ExprKind::kTuple, t);
    tuple->children.push_back(std::move(first));
    while (accept_op(",")) {
      if (at_tag_end()) break;
      tuple->children.push_back(parse_expression(with_condexpr));
    }
    return tuple;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    Nest nest(*this, cur());
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr node = parse_or();
    while (cur().type == Tok::kName && cur().text == "if") {
      auto c = expr(ExprKind::kCond, cur());
      ++pos_;
      ExprPtr condition = parse_or();
      ExprPtr otherwise = accept_name("else") ? parse_condexpr() : nullptr;
      c->children.push_back(std::move(node));
      c->children.push_back(std::move(condition));
      c->children.push_back(std::move(otherwise));
      node = std::move(c);
    }
    return node;
  }

  ExprPtr parse_or() {
    ExprPtr node = parse_and();
    while (cur().type == Tok::kName && cur().text == "or") node = binary(ExprKind::kOr, std::move(node), [&] { return parse_and(); });
    return node;
  }

  ExprPtr parse_and() {
    ExprPtr node = parse_not();
    while (cur().type == Tok::kName && cur().text == "and") node = binary(ExprKind::kAnd, std::move(node), [&] { return parse_not(); });
    return node;
  }

  ExprPtr parse_not() {
    if (cur().type == Tok::kName && cur().text == "not") {
      Nest nest(*this, cur());
      auto n = expr(ExprKind::kNot, cur());
      ++pos_;
      n->children.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& t = cur();
    ExprPtr first = parse_add();
    ExprPtr node;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                     cur().text == "<=" || cur().text == ">" || cur().text == ">=")) {
        op = cur().text;
        ++pos_;
      } else if (accept_name("in")) {
        op = "in";
      } else if (cur().type == Tok::kName && cur().text == "not" && toks_[pos_ + 1].type == Tok::kName &&
                 toks_[pos_ + 1].text == "in") {
        pos_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!node) {
        node = expr(ExprKind::kCompare, t);
        node->children.push_back(std::move(first));
      }
      node->ops.push_back(op);
      node->children.push_back(parse_add());
    }
    return node ? std::move(node) : std::move(first);
  }

  ExprPtr parse_add() { return binary_ops({"+", "-"}, [&] { return parse_concat(); }); }
  ExprPtr parse_concat() { return binary_ops({"~"}, [&] { return parse_mul(); }); }
  ExprPtr parse_mul() { return binary_ops({"*", "/", "//", "%"}, [&] { return parse_pow(); }); }
  ExprPtr parse_pow() { return binary_ops({"**"}, [&] { return parse_unary(true); }); }

  template <typename Next>
  ExprPtr binary_ops(const std::set<std::string>& ops, Next next) {
    ExprPtr node = next();
    while (cur().type == Tok::kOp && ops.count(cur().text)) {
      std::string op = cur().text;
      node = binary(ExprKind::kBinary, std::move(node), next);
      node->name = op;
    }
    return node;
  }

  template <typename Next>
  ExprPtr binary(ExprKind kind, ExprPtr left, Next next) {
    auto b = expr(kind, cur());
    ++pos_;
    b->children.push_back(std::move(left));
    b->children.push_back(next());
    return b;
  }

  ExprPtr parse_unary(bool with_filter) {
    const Token& t = cur();
    ExprPtr node;
    if (t.type == Tok::kOp && (t.text == "-" || t.text == "+")) {
      Nest nest(*this, t);
      node = expr(t.text == "-" ? ExprKind::kNeg : ExprKind::kPos, t);
      ++pos_;
      node->children.push_back(parse_unary(false));
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    return with_filter ? parse_filter_expr(std::move(node)) : std::move(node);
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    if (t.type == Tok::kName) {
      ++pos_;
      if (t.text == "true" || t.text == "True") return literal(t, Value::boolean(true));
      if (t.text == "false" || t.text == "False") return literal(t, Value::boolean(false));
      if (t.text == "none" || t.text == "None") return literal(t, Value::none());
      auto n = expr(ExprKind::kName, t);
      n->name = t.text;
      return n;
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (cur().type == Tok::kString) s += toks_[pos_++].text;  // adjacent literals join
      return literal(t, Value::string(s));
    }
    if (t.type == Tok::kInt) return ++pos_, literal(t, Value::integer(t.int_value));
    if (t.type == Tok::kFloat) return ++pos_, literal(t, Value::real(t.float_value));
    if (accept_op("(")) {
      if (accept_op(")")) return expr(ExprKind::kTuple, t);
      ExprPtr inner = parse_tuple(true);
      expect_op(")");
      return inner;
    }
    if (accept_op("[")) return parse_sequence(t, ExprKind::kList, "]");
    if (accept_op("{")) {
      auto d = expr(ExprKind::kDict, t);
      while (!accept_op("}")) {
        if (!d->children.empty()) expect_op(",");
        if (accept_op("}")) break;
        d->children.push_back(parse_expression(true));
        expect_op(":");
        d->children.push_back(parse_expression(true));
      }
      return d;
    }
    fail(t, t.type == Tok::kEnd || t.type == Tok::kVarEnd || t.type == Tok::kBlockEnd
                ? std::string("unexpected end of expression")
                : "unexpected '" + t.text + "'");
  }

  ExprPtr parse_sequence(const Token& t, ExprKind kind, const char* close) {
    auto seq = expr(kind, t);
    while (!accept_op(close)) {
      if (!seq->children.empty()) expect_op(",");
      if (accept_op(close)) break;
      seq->children.push_back(parse_expression(true));
    }
    return seq;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (cur().type == Tok::kOp) {
      const Token& t = cur();
      if (t.text == ".") {
        ++pos_;
        if (cur().type == Tok::kInt) {  // foo.0 is foo[0]
          auto item = expr(ExprKind::kItem, t);
          item->children.push_back(std::move(node));
          item->children.push_back(literal(cur(), Value::integer(cur().int_value)));
          ++pos_;
          node = std::move(item);
          continue;
        }
        auto attr = expr(ExprKind::kAttr, t);
        attr->name = expect_name();
        attr->children.push_back(std::move(node));
        node = std::move(attr);
      } else if (t.text == "[") {
        ++pos_;
        node = parse_subscript(t, std::move(node));
      } else if (t.text == "(") {
        node = parse_call(std::move(node));
      } else {
        break;
      }
    }
    return node;
  }

  ExprPtr parse_subscript(const Token& t, ExprPtr object) {
    ExprPtr parts[3];
    int part = 0;
    bool slice = false;
    while (!accept_op("]")) {
      if (accept_op(":")) {
        if (++part > 2) fail(t, "too many ':' in slice");
        slice = true;
        continue;
      }
      if (parts[part]) fail(cur(), "expected ']'");
      parts[part] = parse_expression(true);
    }
    if (!slice && !parts[0]) fail(t, "expected a subscript");
    auto node = expr(slice ? ExprKind::kSlice : ExprKind::kItem, t);
    node->children.push_back(std::move(object));
    for (int k = 0; k < (slice ? 3 : 1); ++k) node->children.push_back(std::move(parts[k]));
    return node;
  }

  // `(a, b, key=c)`: positional then keyword, as Python requires; *args/**kwargs are refused.
  void parse_call_args(std::vector<ExprPtr>& positional, Kwargs& kwargs) {
    expect_op("(");
    bool first = true;
    while (!accept_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (accept_op(")")) break;
      if (cur().type == Tok::kOp && (cur().text == "*" || cur().text == "**")) {
        fail(cur(), "*args and **kwargs in calls are outside the supported Jinja subset");
      }
      if (cur().type == Tok::kName && toks_[pos_ + 1].type == Tok::kOp && toks_[pos_ + 1].text == "=") {
        std::string key = cur().text;
        pos_ += 2;
        kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!kwargs.empty()) fail(cur(), "positional argument follows keyword argument");
        positional.push_back(parse_expression(true));
      }
    }
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = expr(ExprKind::kCall, cur());
    call->children.push_back(std::move(callee));
    parse_call_args(call->children, call->kwargs);
    return call;
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (accept_op("|")) {
        node = parse_filter(std::move(node));
      } else if (cur().type == Tok::kName && cur().text == "is") {
        node = parse_test(std::move(node));
      } else if (cur().type == Tok::kOp && cur().text == "(") {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter(ExprPtr operand) {
    const Token& t = cur();
    auto f = expr(ExprKind::kFilter, t);
    f->name = expect_name();
    if (!has_filter(f->name)) fail(t, "no filter named '" + f->name + "' (outside the supported Jinja subset)");
    f->children.push_back(std::move(operand));
    if (cur().type == Tok::kOp && cur().text == "(") parse_call_args(f->children, f->kwargs);
    return f;
  }

  ExprPtr parse_test(ExprPtr operand) {
    auto test = expr(ExprKind::kTest, cur());
    ++pos_;  // is
    test->negated = accept_name("not");
    const Token& t = cur();
    test->name = expect_name();
    if (!has_test(test->name)) fail(t, "no test named '" + test->name + "' (outside the supported Jinja subset)");
    test->children.push_back(std::move(operand));
    const Token& next = cur();
    if (next.type == Tok::kOp && next.text == "(") {
      parse_call_args(test->children, test->kwargs);
    } else if ((next.type == Tok::kName && next.text != "else" && next.text != "or" && next.text != "and") ||
               next.type == Tok::kString || next.type == Tok::kInt || next.type == Tok::kFloat ||
               (next.type == Tok::kOp && (next.text == "[" || next.text == "{"))) {
      // jinja2 takes one bare argument: `x is divisibleby 3`, `x is sameas false`.
      if (next.type == Tok::kName && next.text == "is") fail(next, "You cannot chain multiple tests with is");
      test->children.push_back(parse_postfix(parse_primary()));
    }
    return test;
  }

  // --- helpers -------------------------------------------------------------------------------
  const Token& cur() const { return toks_[pos_]; }
  bool at_tag_end() const {
    Tok t = cur().type;
    return t == Tok::kVarEnd || t == Tok::kBlockEnd || (t == Tok::kOp && (cur().text == ")" || cur().text == "="));
  }

  bool accept_op(const char* op) {
    if (cur().type == Tok::kOp && cur().text == op) return ++pos_, true;
    return false;
  }
  bool accept_name(const char* name) {
    if (cur().type == Tok::kName && cur().text == name) return ++pos_, true;
    return false;
  }
  void expect_op(const char* op) {
    if (!accept_op(op)) fail(cur(), std::string("expected '") + op + "'");
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) fail(cur(), "expected a name");
    return toks_[pos_++].text;
  }
  void expect(Tok type, const char* what) {
    if (cur().type != type) fail(cur(), std::string("expected ") + what);
    ++pos_;
  }

  StmtPtr stmt(StmtKind kind, const Token& t) const {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = t.line;
    s->col = t.col;
    return s;
  }
  ExprPtr expr(ExprKind kind, const Token& t) const {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = t.line;
    e->col = t.col;
    return e;
  }
  ExprPtr literal(const Token& t, Value v) const {
    auto e = expr(ExprKind::kLiteral, t);
    e->literal = std::move(v);
    return e;
  }

  [[noreturn]] void fail(const Token& t, const std::string& what) const {
    throw TemplateError(origin_ + ":" + std::to_string(t.line) + ":" + std::to_string(t.col) + ": " + what);
  }

  const std::vector<Token>& toks_;
  const std::string& origin_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;

  // Parsing and evaluating recurse as deep as the template nests: an untrusted template of 30,000
  // parentheses would overflow the stack. Real templates nest a dozen levels.
  struct Nest {
    Parser& p;
    Nest(Parser& parser, const Token& t) : p(parser) {
      if (++p.nesting_ > 100) p.fail(t, "the template nests deeper than 100 levels");
    }
    ~Nest() { --p.nesting_; }
  };
};

}  // namespace

Program parse_program(const std::vector<Token>& tokens, const std::string& origin) {
  Program program;
  program.origin = origin;
  program.body = Parser(tokens, origin).parse_all();
  return program;
}

}  // namespace qlora::jinja
