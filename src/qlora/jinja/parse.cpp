// Lexing (text, {{ }}, {% %}, {# #} with jinja2's whitespace rules as transformers sets them:
// trim_blocks, lstrip_blocks, and the "-" / "+" markers) and parsing into ast.h's tree.
#include <algorithm>
#include <cctype>
#include <functional>

#include "qlora/jinja/ast.h"
#include "qlora/jinja/template.h"

namespace qlora::jinja {
namespace {

struct Tok {
  enum Type { kName, kString, kInt, kFloat, kOp, kEnd } type;
  std::string text;
  Where where;
};

// A {{ }} or {% %} tag's tokens, or a stretch of text.
struct Piece {
  enum Type { kText, kVar, kBlock } type;
  std::string text;
  std::vector<Tok> toks;
  Where where;
};

class Lexer {
 public:
  Lexer(const std::string& src, const std::string& origin) : src_(src), origin_(origin) {}

  std::vector<Piece> run() {
    size_t pos = 0;
    bool strip_next = false;  // a "-" closed the last tag
    while (pos < src_.size()) {
      const size_t at = find_tag(pos);
      std::string text = src_.substr(pos, at - pos);
      const Where text_where = where(pos);
      if (strip_next) text.erase(0, text.find_first_not_of(" \t\r\n\f\v") == std::string::npos ? text.size()
                                                                                             : text.find_first_not_of(" \t\r\n\f\v"));
      if (at == src_.size()) {
        if (!text.empty()) out_.push_back({Piece::kText, text, {}, text_where});
        break;
      }
      const char kind = src_[at + 1];
      const char marker = at + 2 < src_.size() ? src_[at + 2] : '\0';
      if (marker == '-') {
        text.erase(text.find_last_not_of(" \t\r\n\f\v") + 1);
      } else if (kind != '{' && marker != '+') {
        // lstrip_blocks: spaces and tabs between a line's start and a block or comment tag go.
        const size_t nl = text.rfind('\n');
        const size_t line_start = nl == std::string::npos ? 0 : nl + 1;
        const bool at_line_start = nl != std::string::npos || pos == 0 || src_[pos - 1] == '\n';
        if (at_line_start && text.find_first_not_of(" \t", line_start) == std::string::npos) text.erase(line_start);
      }
      if (!text.empty()) out_.push_back({Piece::kText, text, {}, text_where});
      size_t body = at + 2 + ((marker == '-' || marker == '+') ? 1 : 0);
      if (kind == '#') {
        const size_t close = src_.find("#}", body);
        if (close == std::string::npos) fail(at, "unclosed comment");
        strip_next = close > 0 && src_[close - 1] == '-';
        pos = trim_newline(close + 2);
        continue;
      }
      std::vector<Tok> toks;
      size_t end = lex_tag(body, kind == '{' ? '}' : '%', toks, strip_next);
      if (kind == '{') {
        out_.push_back({Piece::kVar, "", std::move(toks), where(at)});
        pos = end;
        continue;
      }
      if (!toks.empty() && toks[0].type == Tok::kName && toks[0].text == "raw") {
        pos = raw_block(trim_newline(end), at);
        continue;
      }
      out_.push_back({Piece::kBlock, "", std::move(toks), where(at)});
      pos = strip_next ? end : trim_newline(end);
    }
    return std::move(out_);
  }

 private:
  const std::string& src_;
  const std::string& origin_;
  std::vector<Piece> out_;

  Where where(size_t offset) const {
    Where w;
    for (size_t i = 0; i < offset && i < src_.size(); ++i) {
      if (src_[i] == '\n') ++w.line, w.column = 1;
      else ++w.column;
    }
    return w;
  }
  [[noreturn]] void fail(size_t offset, const std::string& what) const {
    const Where w = where(offset);
    throw TemplateError(origin_ + ":" + std::to_string(w.line) + ":" + std::to_string(w.column) + ": " + what);
  }
  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string::npos; p = src_.find('{', p + 1))
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) return p;
    return src_.size();
  }
  // trim_blocks: the first newline after a block tag goes.
  size_t trim_newline(size_t p) const {
    if (p < src_.size() && src_[p] == '\n') return p + 1;
    if (p + 1 < src_.size() && src_[p] == '\r' && src_[p + 1] == '\n') return p + 2;
    return p;
  }
  size_t raw_block(size_t from, size_t tag_at) {
    for (size_t p = src_.find("{%", from); p != std::string::npos; p = src_.find("{%", p + 2)) {
      size_t q = p + 2;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) ++q;
      while (q < src_.size() && std::isspace(static_cast<unsigned char>(src_[q]))) ++q;
      if (src_.compare(q, 6, "endraw") != 0) continue;
      std::string text = src_.substr(from, p - from);
      if (src_[p + 2] == '-') text.erase(text.find_last_not_of(" \t\r\n") + 1);
      out_.push_back({Piece::kText, text, {}, where(from)});
      const size_t close = src_.find("%}", q);
      if (close == std::string::npos) fail(p, "unclosed endraw tag");
      return trim_newline(close + 2);
    }
    fail(tag_at, "raw block without endraw");
  }
  // Tokens up to the closing "}}" / "%}"; returns the offset after it.
  size_t lex_tag(size_t p, char close, std::vector<Tok>& toks, bool& strip_next) {
    static const char* const kOps2[] = {"==", "!=", "<=", ">=", "//", "**"};
    while (p < src_.size()) {
      const char c = src_[p];
      if (std::isspace(static_cast<unsigned char>(c))) { ++p; continue; }
      const bool dash_close = c == '-' && p + 2 < src_.size() && src_[p + 1] == close && src_[p + 2] == '}';
      if (dash_close || (c == close && p + 1 < src_.size() && src_[p + 1] == '}')) {
        strip_next = dash_close;
        toks.push_back({Tok::kEnd, "", where(p)});
        return p + (dash_close ? 3 : 2);
      }
      const Where w = where(p);
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t e = p;
        while (e < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        toks.push_back({Tok::kName, src_.substr(p, e - p), w});
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = p;
        bool is_float = false;
        while (e < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_')) ++e;
        if (e + 1 < src_.size() && src_[e] == '.' && std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          for (++e; e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e])); ++e) {}
        }
        std::string num = src_.substr(p, e - p);
        num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
        toks.push_back({is_float ? Tok::kFloat : Tok::kInt, num, w});
        p = e;
      } else if (c == '\'' || c == '"') {
        toks.push_back({Tok::kString, string_literal(p), w});
      } else {
        std::string op(1, c);
        for (const char* o : kOps2)
          if (src_.compare(p, 2, o) == 0) op = o;
        if (std::string("+-*/%~<>=()[]{}.,:|!").find(c) == std::string::npos) fail(p, std::string("unexpected character '") + c + "'");
        toks.push_back({Tok::kOp, op, w});
        p += op.size();
      }
    }
    fail(p, std::string("unclosed tag (expected '") + close + "}')");
  }
  // A quoted literal with Python's escapes; p moves past the closing quote.
  std::string string_literal(size_t& p) {
    const char q = src_[p];
    const size_t start = p++;
    std::string out;
    while (p < src_.size() && src_[p] != q) {
      char c = src_[p++];
      if (c != '\\' || p >= src_.size()) {
        out += c;
        continue;
      }
      c = src_[p++];
      switch (c) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '0': out += '\0'; break;
        case '\\': case '\'': case '"': out += c; break;
        case '\n': break;
        default: out += '\\', out += c;  // Python keeps unknown escapes as they are
      }
    }
    if (p >= src_.size()) fail(start, "unterminated string");
    ++p;
    return out;
  }
};

// ---- the parser ------------------------------------------------------------------------------

std::shared_ptr<Stmt> new_stmt(Stmt::Kind kind, Where w) {
  auto s = std::make_shared<Stmt>();
  s->kind = kind;
  s->where = w;
  return s;
}

class Parser {
 public:
  Parser(std::vector<Piece> pieces, const std::string& origin) : pieces_(std::move(pieces)), origin_(origin) {}

  Body run() {
    Body body = parse_body({});
    if (at_ < pieces_.size()) fail(pieces_[at_].where, "unexpected '" + keyword(pieces_[at_]) + "'");
    return body;
  }

 private:
  std::vector<Piece> pieces_;
  const std::string& origin_;
  size_t at_ = 0;      // current piece
  const std::vector<Tok>* toks_ = nullptr;
  size_t t_ = 0;       // current token in *toks_

  [[noreturn]] void fail(Where w, const std::string& what) const {
    throw TemplateError(origin_ + ":" + std::to_string(w.line) + ":" + std::to_string(w.column) + ": " + what);
  }
  static std::string keyword(const Piece& p) {
    return p.toks.empty() || p.toks[0].type != Tok::kName ? "" : p.toks[0].text;
  }

  // Statements until a block tag whose keyword is in `stops` (left unconsumed).
  Body parse_body(const std::vector<std::string>& stops) {
    Body body;
    while (at_ < pieces_.size()) {
      const Piece& p = pieces_[at_];
      if (p.type == Piece::kText) {
        auto s = new_stmt(Stmt::Kind::kText, p.where);
        s->text = p.text;
        body.push_back(s);
        ++at_;
        continue;
      }
      begin_tokens(p);
      if (p.type == Piece::kVar) {
        auto s = new_stmt(Stmt::Kind::kOutput, p.where);
        s->expr = expression();
        end_tokens();
        body.push_back(s);
        ++at_;
        continue;
      }
      const std::string kw = keyword(p);
      if (std::find(stops.begin(), stops.end(), kw) != stops.end()) return body;
      ++at_;
      body.push_back(statement(kw, p.where));
    }
    if (!stops.empty()) fail(pieces_.empty() ? Where{} : pieces_.back().where, "missing '{% " + stops.back() + " %}'");
    return body;
  }

  void begin_tokens(const Piece& p) {
    toks_ = &p.toks;
    t_ = 0;
  }
  const Tok& peek(size_t ahead = 0) const { return (*toks_)[std::min(t_ + ahead, toks_->size() - 1)]; }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).type == Tok::kOp && peek(ahead).text == op; }
  bool is_name(const char* name, size_t ahead = 0) const {
    return peek(ahead).type == Tok::kName && peek(ahead).text == name;
  }
  const Tok& next() { return (*toks_)[t_ < toks_->size() - 1 ? t_++ : t_]; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(peek().where, std::string("expected '") + op + "', got '" + peek().text + "'");
    ++t_;
  }
  std::string expect_name() {
    if (peek().type != Tok::kName) fail(peek().where, "expected a name, got '" + peek().text + "'");
    return next().text;
  }
  void end_tokens() {
    if (peek().type != Tok::kEnd) fail(peek().where, "unexpected '" + peek().text + "' (expected the end of the tag)");
  }
  // The closing tag `kw` (e.g. endfor), consumed.
  void close(const std::string& kw) {
    begin_tokens(pieces_[at_]);
    ++t_;
    end_tokens();
    ++at_;
    (void)kw;
  }

  StmtPtr statement(const std::string& kw, Where w) {
    ++t_;  // the keyword
    auto s = new_stmt(Stmt::Kind::kText, w);
    if (kw == "if") {
      s->kind = Stmt::Kind::kIf;
      ExprPtr cond = expression();
      end_tokens();
      for (;;) {
        Body b = parse_body({"elif", "else", "endif"});
        s->branches.emplace_back(cond, std::move(b));
        const std::string k = keyword(pieces_[at_]);
        if (k == "elif") {
          begin_tokens(pieces_[at_++]);
          ++t_;
          cond = expression();
          end_tokens();
          continue;
        }
        if (k == "else") {
          close("else");
          s->else_body = parse_body({"endif"});
        }
        close("endif");
        return s;
      }
    }
    if (kw == "for") {
      s->kind = Stmt::Kind::kFor;
      s->targets.push_back(expect_name());
      while (is_op(",")) ++t_, s->targets.push_back(expect_name());
      if (!is_name("in")) fail(peek().where, "expected 'in' in a for loop");
      ++t_;
      s->expr = or_expr();
      if (is_name("if")) ++t_, s->filter = or_expr();
      if (is_name("recursive")) fail(peek().where, "recursive loops are not supported");
      end_tokens();
      s->body = parse_body({"else", "endfor"});
      if (keyword(pieces_[at_]) == "else") {
        close("else");
        s->else_body = parse_body({"endfor"});
      }
      close("endfor");
      return s;
    }
    if (kw == "set") {
      s->kind = Stmt::Kind::kSet;
      s->targets.push_back(expect_name());
      if (is_op(".")) ++t_, s->attr = expect_name();
      while (is_op(",")) ++t_, s->targets.push_back(expect_name());
      if (is_op("=")) {
        ++t_;
        s->expr = tuple_or_expr();
        end_tokens();
        return s;
      }
      end_tokens();
      if (s->targets.size() != 1 || !s->attr.empty()) fail(w, "a block set takes one name");
      s->body = parse_body({"endset"});
      close("endset");
      return s;
    }
    if (kw == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        s->params.push_back(expect_name());
        ExprPtr def;
        if (is_op("=")) ++t_, def = expression();
        s->defaults.push_back(def);
        if (!is_op(")")) expect_op(",");
      }
      ++t_;
      end_tokens();
      s->body = parse_body({"endmacro"});
      close("endmacro");
      return s;
    }
    if (kw == "break" || kw == "continue") {
      end_tokens();
      s->kind = kw == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      return s;
    }
    if (kw == "generation") {
      end_tokens();
      s->kind = Stmt::Kind::kGeneration;
      s->body = parse_body({"endgeneration"});
      close("endgeneration");
      return s;
    }
    if (kw == "filter") {
      s->kind = Stmt::Kind::kFilterBlock;
      auto f = std::const_pointer_cast<Expr>(make(Expr::Op::kFilter, w, {nullptr}, expect_name()));
      if (is_op("(")) ++t_, call_args(*f);
      end_tokens();
      s->expr = f;
      s->body = parse_body({"endfilter"});
      close("endfilter");
      return s;
    }
    fail(w, "'{% " + kw + " %}' is not supported by qlora's chat-template interpreter");
  }

  // ---- expressions, lowest precedence first (jinja2's order) ----
  ExprPtr make(Expr::Op op, Where w, std::vector<ExprPtr> args = {}, std::string name = "") {
    auto e = std::make_shared<Expr>();
    e->op = op;
    e->where = w;
    e->args = std::move(args);
    e->name = std::move(name);
    return e;
  }
  // "a, b" without brackets (set x = a, b) is a tuple.
  ExprPtr tuple_or_expr() {
    const Where w = peek().where;
    ExprPtr first = expression();
    if (!is_op(",")) return first;
    std::vector<ExprPtr> items{first};
    while (is_op(",")) {
      ++t_;
      if (peek().type == Tok::kEnd) break;
      items.push_back(expression());
    }
    return make(Expr::Op::kList, w, std::move(items));
  }
  ExprPtr expression() {
    ExprPtr e = or_expr();
    while (is_name("if")) {
      const Where w = next().where;
      ExprPtr cond = or_expr();
      ExprPtr other;
      if (is_name("else")) ++t_, other = or_expr();
      e = make(Expr::Op::kCondition, w, {cond, e, other});
    }
    return e;
  }
  ExprPtr binary_chain(const std::function<ExprPtr()>& operand, const std::vector<std::string>& ops, bool names) {
    ExprPtr e = operand();
    for (;;) {
      const Tok& t = peek();
      const bool match = (names ? t.type == Tok::kName : t.type == Tok::kOp) &&
                         std::find(ops.begin(), ops.end(), t.text) != ops.end();
      if (!match) return e;
      ++t_;
      e = make(Expr::Op::kBinary, t.where, {e, operand()}, t.text);
    }
  }
  ExprPtr or_expr() { return binary_chain([&] { return and_expr(); }, {"or"}, true); }
  ExprPtr and_expr() { return binary_chain([&] { return not_expr(); }, {"and"}, true); }
  ExprPtr not_expr() {
    if (is_name("not")) {
      const Where w = next().where;
      return make(Expr::Op::kUnary, w, {not_expr()}, "not");
    }
    return compare();
  }
  ExprPtr compare() {
    ExprPtr e = math1();
    for (;;) {
      const Tok& t = peek();
      std::string op;
      if (t.type == Tok::kOp && (t.text == "==" || t.text == "!=" || t.text == "<" || t.text == ">" || t.text == "<=" ||
                                 t.text == ">="))
        op = t.text, ++t_;
      else if (is_name("in")) op = "in", ++t_;
      else if (is_name("not") && is_name("in", 1)) op = "not in", t_ += 2;
      else return e;
      e = make(Expr::Op::kBinary, t.where, {e, math1()}, op);
    }
  }
  ExprPtr math1() { return binary_chain([&] { return concat(); }, {"+", "-"}, false); }
  ExprPtr concat() { return binary_chain([&] { return math2(); }, {"~"}, false); }
  ExprPtr math2() { return binary_chain([&] { return power(); }, {"*", "/", "//", "%"}, false); }
  ExprPtr power() { return binary_chain([&] { return unary(); }, {"**"}, false); }
  ExprPtr unary() {
    if (is_op("-") || is_op("+")) {
      const Tok& t = next();
      return make(Expr::Op::kUnary, t.where, {unary()}, t.text);
    }
    return postfix(primary());
  }
  ExprPtr primary() {
    const Tok& t = next();
    switch (t.type) {
      case Tok::kString: {
        std::string s = t.text;
        while (peek().type == Tok::kString) s += next().text;  // adjacent literals join
        auto e = make(Expr::Op::kLiteral, t.where);
        std::const_pointer_cast<Expr>(e)->value = Value(s);
        return e;
      }
      case Tok::kInt:
      case Tok::kFloat: {
        auto e = std::const_pointer_cast<Expr>(make(Expr::Op::kLiteral, t.where));
        e->value = t.type == Tok::kInt ? Value(static_cast<int64_t>(std::stoll(t.text))) : Value(std::stod(t.text));
        return e;
      }
      case Tok::kName: {
        auto e = std::const_pointer_cast<Expr>(make(Expr::Op::kLiteral, t.where));
        if (t.text == "true" || t.text == "True") e->value = Value(true);
        else if (t.text == "false" || t.text == "False") e->value = Value(false);
        else if (t.text == "none" || t.text == "None") e->value = Value::none();
        else return make(Expr::Op::kName, t.where, {}, t.text);
        return e;
      }
      case Tok::kOp:
        if (t.text == "(") {
          if (is_op(")")) return ++t_, make(Expr::Op::kList, t.where);
          ExprPtr e = expression();
          if (is_op(",")) {
            std::vector<ExprPtr> items{e};
            while (is_op(",") && !is_op(")", 1)) ++t_, items.push_back(expression());
            if (is_op(",")) ++t_;
            e = make(Expr::Op::kList, t.where, std::move(items));
          }
          expect_op(")");
          return e;
        }
        if (t.text == "[") return sequence(t.where, "]", false);
        if (t.text == "{") return sequence(t.where, "}", true);
        break;
      default: break;
    }
    fail(t.where, t.type == Tok::kEnd ? "unexpected end of expression" : "unexpected '" + t.text + "'");
  }
  ExprPtr sequence(Where w, const char* close_op, bool dict) {
    std::vector<ExprPtr> items;
    while (!is_op(close_op)) {
      items.push_back(expression());
      if (dict) expect_op(":"), items.push_back(expression());
      if (!is_op(close_op)) expect_op(",");
    }
    ++t_;
    return make(dict ? Expr::Op::kDict : Expr::Op::kList, w, std::move(items));
  }
  // Call arguments after "(": positional, then name=value.
  void call_args(Expr& call) {
    while (!is_op(")")) {
      if (peek().type == Tok::kName && is_op("=", 1)) {
        call.kwarg_names.push_back(next().text);
        ++t_;
      } else if (!call.kwarg_names.empty()) {
        fail(peek().where, "positional argument after a keyword argument");
      }
      call.args.push_back(expression());
      if (!is_op(")")) expect_op(",");
    }
    ++t_;
  }
  ExprPtr postfix(ExprPtr e) {
    for (;;) {
      const Where w = peek().where;
      if (is_op(".")) {
        ++t_;
        e = make(Expr::Op::kAttr, w, {e}, expect_name());
      } else if (is_op("[")) {
        ++t_;
        e = subscript(e, w);
      } else if (is_op("(")) {
        ++t_;
        auto call = std::const_pointer_cast<Expr>(make(Expr::Op::kCall, w, {e}));
        call_args(*call);
        e = call;
      } else if (is_op("|")) {
        ++t_;
        auto f = std::const_pointer_cast<Expr>(make(Expr::Op::kFilter, w, {e}, expect_name()));
        if (is_op("(")) ++t_, call_args(*f);
        e = f;
      } else if (is_name("is")) {
        ++t_;
        auto test = std::const_pointer_cast<Expr>(make(Expr::Op::kTest, w, {e}));
        if (is_name("not")) ++t_, test->negate = true;
        test->name = peek().type == Tok::kName ? next().text : "";
        if (test->name.empty()) fail(peek().where, "expected a test name after 'is'");
        if (is_op("(")) ++t_, call_args(*test);
        else if (peek().type == Tok::kString || peek().type == Tok::kInt || peek().type == Tok::kFloat ||
                 (peek().type == Tok::kName && !is_name("and") && !is_name("or") && !is_name("else") &&
                  !is_name("if") && !is_name("in") && !is_name("not") && !is_name("is")))
          test->args.push_back(primary());
        e = test;
      } else {
        return e;
      }
    }
  }
  ExprPtr subscript(ExprPtr target, Where w) {
    ExprPtr parts[3];
    int part = 0;
    bool slice = false;
    while (!is_op("]")) {
      if (is_op(":")) {
        ++t_;
        slice = true;
        if (++part > 2) fail(peek().where, "a slice has at most three parts");
        continue;
      }
      parts[part] = expression();
    }
    ++t_;
    if (!slice) return make(Expr::Op::kIndex, w, {target, parts[0]});
    return make(Expr::Op::kSlice, w, {target, parts[0], parts[1], parts[2]});
  }
};

}  // namespace

Body parse_template(const std::string& source, const std::string& origin) {
  return Parser(Lexer(source, origin).run(), origin).run();
}

}  // namespace qlora::jinja
